"""BERT encoder forward pass in NumPy, with the attention inputs of each layer captured.

Matches Hugging Face's BertModel (eval mode, one unpadded sequence, token_type 0):
  x = LayerNorm(word[ids] + position[0..T-1] + token_type[0])
  per layer:  q, k, v = x Wq^T + bq, x Wk^T + bk, x Wv^T + bv      (split into heads)
              ctx = softmax(q k^T / sqrt(head_dim)) v                  (bidirectional)
              x = LayerNorm(x + ctx Wo^T + bo)
              x = LayerNorm(x + act(x Wi^T + bi) Wo2^T + bo2)
Weight names are those of the Hugging Face safetensors file (an optional prefix such as
"bert." is detected).
"""
import math

import numpy as np

_erf = np.frompyfunc(math.erf, 1, 1)


def gelu_erf(x):
    """Exact GELU 0.5 x (1 + erf(x / sqrt 2)) (Hugging Face "gelu"), erf evaluated in float64."""
    x64 = x.astype(np.float64)
    return (0.5 * x64 * (1.0 + _erf(x64 / math.sqrt(2.0)).astype(np.float64))).astype(x.dtype)


def gelu_tanh(x):
    """Tanh approximation of GELU (Hugging Face "gelu_new" / "gelu_pytorch_tanh")."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


ACTIVATIONS = {
    "gelu": gelu_erf,
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "relu": lambda x: np.maximum(x, 0),
}

LAYER_TENSORS = [
    "attention.self.query.weight", "attention.self.query.bias",
    "attention.self.key.weight", "attention.self.key.bias",
    "attention.self.value.weight", "attention.self.value.bias",
    "attention.output.dense.weight", "attention.output.dense.bias",
    "attention.output.LayerNorm.weight", "attention.output.LayerNorm.bias",
    "intermediate.dense.weight", "intermediate.dense.bias",
    "output.dense.weight", "output.dense.bias",
    "output.LayerNorm.weight", "output.LayerNorm.bias",
]
EMBEDDING_TENSORS = [
    "embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
    "embeddings.token_type_embeddings.weight",
    "embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias",
]


def layer_norm(x, w, b, eps):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def softmax(s):
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


def find_prefix(names):
    """The prefix before 'embeddings.word_embeddings.weight' ('' for BertModel, 'bert.' for heads)."""
    suffix = "embeddings.word_embeddings.weight"
    hits = sorted(n[: -len(suffix)] for n in names if n.endswith(suffix))
    return hits[0] if hits else None


class Bert:
    """A BERT encoder from its config dict and {name: ndarray} weights."""

    def __init__(self, config, weights, dtype=np.float32):
        self.hidden = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.layers = int(config["num_hidden_layers"])
        self.head_dim = self.hidden // self.heads
        self.max_positions = int(config["max_position_embeddings"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        act = config.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[act]
        self.dtype = np.dtype(dtype)
        prefix = find_prefix(weights)
        if prefix is None:
            raise KeyError("embeddings.word_embeddings.weight")
        self.prefix = prefix
        need = [prefix + n for n in EMBEDDING_TENSORS]
        need += [f"{prefix}encoder.layer.{i}.{n}" for i in range(self.layers) for n in LAYER_TENSORS]
        missing = [n for n in need if n not in weights]
        if missing:
            raise KeyError(missing[0])
        self.w = {n[len(prefix):]: np.asarray(weights[n], dtype=self.dtype) for n in need}
        e = self.w["embeddings.word_embeddings.weight"]
        if e.ndim != 2 or e.shape[1] != self.hidden:
            raise ValueError(f"embeddings.word_embeddings.weight has shape {list(e.shape)}, "
                             f"expected [vocab, hidden_size={self.hidden}]")

    def _lin(self, x, name):
        return x @ self.w[name + ".weight"].T + self.w[name + ".bias"]

    def embed(self, ids):
        ids = np.asarray(ids, dtype=np.int64)
        T = ids.shape[0]
        if T > self.max_positions:
            raise ValueError(f"sequence of {T} tokens exceeds max_position_embeddings={self.max_positions}")
        x = (self.w["embeddings.word_embeddings.weight"][ids]
             + self.w["embeddings.position_embeddings.weight"][:T]
             + self.w["embeddings.token_type_embeddings.weight"][0])
        return layer_norm(x, self.w["embeddings.LayerNorm.weight"], self.w["embeddings.LayerNorm.bias"], self.eps)

    def split_heads(self, x):
        """[T, hidden] -> [heads, T, head_dim]."""
        return x.reshape(x.shape[0], self.heads, self.head_dim).transpose(1, 0, 2)

    def forward(self, ids, capture=(), stop_after=None):
        """Runs the encoder on one sequence of token ids.

        Returns (hidden [T, hidden], {layer: {"q","k","v","ctx": [heads, T, head_dim]}}) for the
        layers in `capture`; "ctx" is the attention context softmax(q k^T / sqrt d) v before the
        output projection. With `stop_after=L` the pass ends once layer L's attention context is
        computed, and the hidden state returned is None."""
        x = self.embed(ids)
        captured = {}
        last = self.layers - 1 if stop_after is None else int(stop_after)
        scale = 1.0 / math.sqrt(self.head_dim)
        for i in range(last + 1):
            p = f"encoder.layer.{i}."
            q = self.split_heads(self._lin(x, p + "attention.self.query"))
            k = self.split_heads(self._lin(x, p + "attention.self.key"))
            v = self.split_heads(self._lin(x, p + "attention.self.value"))
            ctx = softmax((q @ k.transpose(0, 2, 1)) * self.dtype.type(scale)) @ v
            if i in capture:
                captured[i] = {"q": q, "k": k, "v": v, "ctx": ctx}
            if stop_after is not None and i == last:
                return None, captured  # the rest of layer `last` is not needed
            merged = ctx.transpose(1, 0, 2).reshape(x.shape[0], self.hidden)
            x = layer_norm(x + self._lin(merged, p + "attention.output.dense"),
                           self.w[p + "attention.output.LayerNorm.weight"],
                           self.w[p + "attention.output.LayerNorm.bias"], self.eps)
            h = self.act(self._lin(x, p + "intermediate.dense"))
            x = layer_norm(x + self._lin(h, p + "output.dense"),
                           self.w[p + "output.LayerNorm.weight"], self.w[p + "output.LayerNorm.bias"], self.eps)
        return x, captured
