"""Per-layer distillation of a memory's own parameters into a pretrained model whose weights stay frozen
(issue 45, stage 1): for each attention layer, the memory's attention output on the layer's captured
queries, keys and values (kvmem.train.capture) is fitted to exact causal attention with Adam.

KVM's parameters per layer (spec KVM.md §1-§3): the merge-gate projection W_g [hidden, Hkv] (z = x . W_g of
the layer's attention input x; starts at 0, the neutral gate g = 1), the state-key LayerNorm's affine
[D] (starts at 1, 0) and the inverse temperatures tau_state, tau_window [Hq] (trained as their logarithms,
so they stay positive; start at 1). OVQ's (spec OVQ.md §2): the logit scale beta [Hq] (trained as its
logarithm; starts at the closed form mean|q| * mean|k| / D per head, which makes beta * sqrt(D) * cos(q, k)
the model's q . k / sqrt(D) for keys and queries of mean norm). The loss is the relative squared error of
the attention output, sum |y - y_exact|^2 / sum |y_exact|^2 over the batch's queries, heads and channels;
the memories' routing decisions are arg-max (kvm-paper Sec. 4, ovq-paper Sec. 3.2: trained through the
folded sums and centroid means, not through the routing).

KVPOP's scorers (kvpop-paper Sec. 2.1, the retrofit with the base model frozen; spec EVICTION.md §3): one
mLSTM scorer per layer and kv-head (kvmem.train.kvpop), trained with the paper's pairwise ranking loss
(eq. 2) against the teacher's decisions from the layer's future-attention importance (App. D): its hard
top-k gives the attention output no gradient, so the ranking loss is what trains it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from .. import budget as budgets
from .capture import LayerInputs, exact_attention
from .kvm import kvm_prefill
from .kvpop import effective_keys, importance_target, kvpop_loss, mlstm_scores, weight_shapes
from .ovq import ovq_prefill


@dataclass(frozen=True)
class KvmSetup:
    """The KVM memory the weights are trained in (kvmem.KvmMemory's arguments): chunk and window_chunks *
    chunk in tokens, sinks and max_rows in rows, a kvmem.budget schedule; rope_dims key channels zeroed."""

    chunk: int
    window_chunks: int
    sinks: int
    max_rows: int
    budget: budgets.Schedule
    rope_dims: int = 0

    def memory_args(self) -> dict:
        """The keyword arguments of kvmem.KvmMemory / kvmem.transformers.kvm for this memory."""
        return {"chunk": self.chunk, "window_chunks": self.window_chunks, "sinks": self.sinks,
                "max_rows": self.max_rows, "budget": self.budget, "rope_dims": self.rope_dims}


class KvmParameters(torch.nn.Module):
    """One layer's trainable KVM parameters (module docstring), float32."""

    def __init__(self, hidden: int, query_heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.gate_weight = torch.nn.Parameter(torch.zeros(hidden, kv_heads))
        self.ln_weight = torch.nn.Parameter(torch.ones(head_dim))
        self.ln_bias = torch.nn.Parameter(torch.zeros(head_dim))
        self.log_tau_state = torch.nn.Parameter(torch.zeros(query_heads))
        self.log_tau_window = torch.nn.Parameter(torch.zeros(query_heads))

    def forward(self, inputs: LayerInputs, setup: KvmSetup) -> torch.Tensor:
        """The memory's attention output [B, Hq, T, Dv] on one layer's captured inputs."""
        gate = (inputs.x @ self.gate_weight).transpose(1, 2)
        return kvm_prefill(inputs.q, inputs.k, inputs.v, gate, self.ln_weight, self.ln_bias, self.log_tau_state.exp(),
                           self.log_tau_window.exp(), **setup.memory_args()).y

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "KvmParameters":
        """The parameters of a layer's tensors (kvmem.weights names, as tensors() gives them)."""
        hidden, kv_heads = tensors["gate_weight"].shape
        p = cls(hidden, tensors["tau_state"].shape[0], kv_heads, tensors["ln_weight"].shape[0])
        with torch.no_grad():
            p.gate_weight.copy_(tensors["gate_weight"])
            p.ln_weight.copy_(tensors["ln_weight"])
            p.ln_bias.copy_(tensors["ln_bias"])
            p.log_tau_state.copy_(tensors["tau_state"].log())
            p.log_tau_window.copy_(tensors["tau_window"].log())
        return p

    def tensors(self) -> dict[str, torch.Tensor]:
        """The layer's tensors as kvmem.weights names them (float32, detached)."""
        return {"gate_weight": self.gate_weight.detach().clone(), "ln_weight": self.ln_weight.detach().clone(),
                "ln_bias": self.ln_bias.detach().clone(), "tau_state": self.log_tau_state.detach().exp(),
                "tau_window": self.log_tau_window.detach().exp()}


@dataclass(frozen=True)
class OvqSetup:
    """The OVQ memory the weights are trained in (kvmem.OvqMemory's arguments): chunk in tokens,
    max_centroids in rows, a kvmem.budget schedule (None: Plateau(max_centroids))."""

    chunk: int
    max_centroids: int
    budget: budgets.Schedule | None = None

    def memory_args(self) -> dict:
        """The keyword arguments of kvmem.OvqMemory / kvmem.transformers.ovq for this memory."""
        args = {"chunk": self.chunk, "max_centroids": self.max_centroids}
        if self.budget is not None:
            args["budget"] = self.budget
        return args


class OvqParameters(torch.nn.Module):
    """One layer's trainable OVQ parameter, beta [Hq] as its logarithm (module docstring), float32."""

    def __init__(self, beta: torch.Tensor):
        super().__init__()
        self.log_beta = torch.nn.Parameter(beta.detach().float().log())

    @staticmethod
    def closed_form(inputs: LayerInputs) -> torch.Tensor:
        """beta0 [Hq] = mean|q| * mean|k| / D per query head (its kv-head's keys), from captured inputs."""
        G = inputs.q.shape[1] // inputs.k.shape[1]
        qn = inputs.q.norm(dim=-1).mean(dim=(0, 2))
        kn = inputs.k.norm(dim=-1).mean(dim=(0, 2)).repeat_interleave(G)
        return qn * kn / inputs.q.shape[-1]

    def forward(self, inputs: LayerInputs, setup: OvqSetup) -> torch.Tensor:
        """The memory's attention output [B, Hq, T, Dv] on one layer's captured inputs."""
        return ovq_prefill(inputs.q, inputs.k, inputs.v, self.log_beta.exp(), **setup.memory_args()).y

    def tensors(self) -> dict[str, torch.Tensor]:
        """The layer's tensors as kvmem.weights names them (float32, detached)."""
        return {"beta": self.log_beta.detach().exp()}


@dataclass(frozen=True)
class KvpopSetup:
    """The KVPOP eviction memory the scorers are trained for (kvmem.EvictionMemory's arguments, in tokens):
    sinks, the recency window and the top_k scored tokens kept."""

    sinks: int
    window: int
    top_k: int

    def memory_args(self) -> dict:
        """The keyword arguments of kvmem.EvictionMemory / kvmem.transformers.eviction for this memory."""
        return {"sinks": self.sinks, "window": self.window, "top_k": self.top_k}


class KvpopParameters(torch.nn.Module):
    """One layer's KVPOP scorers, one per kv-head, as kvmem.weights names them (w_q, w_k, w_v [Hkv, D + Dv,
    D / 2], w_i, w_f [Hkv, D + Dv], b_i, b_f, b_s, theta [Hkv], w_s [Hkv, D / 2]), float32. Initial values:
    projections and gate vectors normal with standard deviation 1 / sqrt(fan-in), b_f = 3 (forget gates
    near 1: a long memory), b_i = b_s = theta = 0 (kvpop-paper App. E leaves the initialization open)."""

    def __init__(self, kv_heads: int, head_dim: int, value_dim: int | None = None, *, seed: int = 0,
                 tensors: dict[str, torch.Tensor] | None = None):
        super().__init__()
        shapes = weight_shapes(kv_heads, head_dim, value_dim)
        g = torch.Generator().manual_seed(seed)
        for name, shape in shapes.items():
            if tensors is not None:
                value = tensors[name].detach().float().clone()
            elif name in ("w_q", "w_k", "w_v", "w_i", "w_f", "w_s"):
                fan_in = shape[1]
                value = torch.randn(shape, generator=g) / fan_in ** 0.5
            else:
                value = torch.full(shape, 3.0 if name == "b_f" else 0.0)
            self.register_parameter(name, torch.nn.Parameter(value))

    def forward(self, inputs: LayerInputs, setup: KvpopSetup) -> torch.Tensor:
        """The static ranking keys kappa [B, Hkv, T] of the layer's captured keys and values (delayed scoring
        with the memory's window, spec EVICTION.md §2-§4)."""
        scores = mlstm_scores(inputs.k, inputs.v, self.tensors(detach=False), window=setup.window)
        return effective_keys(scores, self.theta)

    def tensors(self, detach: bool = True) -> dict[str, torch.Tensor]:
        """The layer's tensors as kvmem.weights names them (float32; detached unless ``detach`` is False)."""
        return {name: (p.detach() if detach else p) for name, p in self.named_parameters()}


def fit_kvpop_layer(batches: list[LayerInputs], setup: KvpopSetup, *, steps: int, lr: float = 3e-3, seed: int = 0,
                    on_step: Callable[[int, float], None] | None = None) -> LayerFit:
    """Fits one layer's KVPOP scorers (KvpopParameters from its initial values, seeded ``seed``) with Adam
    (``lr``) to the layer's teacher on ``batches``: kvpop_loss of the scorers' keys against the target keys
    effective_keys(log m, theta) (theta detached), log m the future-attention importance of the captured
    queries and keys (importance_target, exact dense pass). The curve holds the summed loss over the batches
    before each step and after the last. Raises ValueError for steps < 0 or no batch, and as kvpop_loss."""
    if steps < 0:
        raise ValueError(f"steps = {steps}: must be >= 0")
    if not batches:
        raise ValueError("batches: no captured inputs to fit")
    first = batches[0]
    p = KvpopParameters(first.k.shape[1], first.k.shape[-1], first.v.shape[-1], seed=seed)
    args = {"sinks": setup.sinks, "window": setup.window}
    log_m = [importance_target(b.q, b.k, **args, log=True) for b in batches]

    def losses():
        for b, target in zip(batches, log_m):
            yield kvpop_loss(p(b, setup), effective_keys(target, p.theta.detach()), **args,
                             top_k=setup.top_k) / len(batches)

    curve = _descend(torch.optim.Adam(p.parameters(), lr=lr), losses, steps, on_step)
    return LayerFit(p.tensors(), curve)


def relative_error(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """sum |y - target|^2 / sum |target|^2 (a scalar tensor)."""
    return (y - target).square().sum() / target.square().sum()


@dataclass
class LayerFit:
    """What fit_kvm_layer returns: the layer's tensors (kvmem.weights names) and the loss before each step
    and after the last (``curve``, steps + 1 values: curve[0] is the neutral parameters' loss)."""

    tensors: dict
    curve: list


def fit_layer(params: torch.nn.Module, batches: list[LayerInputs], setup, *, steps: int, groups: list[dict],
              on_step: Callable[[int, float], None] | None = None) -> LayerFit:
    """Fits one layer's parameters ``params`` (KvmParameters or OvqParameters, run with ``setup``) to exact
    attention on ``batches`` (each a LayerInputs of some sequences): ``steps`` Adam steps over all of them
    (gradients summed over the batches), with the parameter groups ``groups`` (torch.optim's, each with its
    lr). ``on_step(step, loss)`` is called after each step. Raises ValueError for steps < 0 or no batch."""
    if steps < 0:
        raise ValueError(f"steps = {steps}: must be >= 0")
    if not batches:
        raise ValueError("batches: no captured inputs to fit")
    targets = [exact_attention(b.q, b.k, b.v) for b in batches]
    curve = _descend(torch.optim.Adam(groups), lambda: (relative_error(params(b, setup), t) / len(batches)
                                                       for b, t in zip(batches, targets)), steps, on_step)
    return LayerFit(params.tensors(), curve)


def _descend(opt, losses: Callable[[], Iterable[torch.Tensor]], steps: int,
             on_step: Callable[[int, float], None] | None) -> list[float]:
    """``steps`` steps of ``opt``, each on the summed gradients of the losses ``losses()`` yields (one per batch,
    backpropagated one at a time so that one batch's graph is held at once), then one more pass that only
    measures. Returns the summed loss before each step and after the last."""
    curve = []
    for step in range(steps + 1):
        opt.zero_grad()
        total = 0.0
        with torch.set_grad_enabled(step < steps):
            for loss in losses():
                if step < steps:
                    loss.backward()
                total += loss.item()
        curve.append(total)
        if step < steps:
            opt.step()
            if on_step is not None:
                on_step(step, total)
    return curve


def _kvm_start(batches: list[LayerInputs], lr: float, gate_lr: float) -> tuple[KvmParameters, list[dict]]:
    """KVM's neutral parameters for the inputs' sizes and their Adam groups: ``gate_lr`` for W_g, ``lr`` for the
    LayerNorm affine and the log-temperatures."""
    first = batches[0]
    p = KvmParameters(first.x.shape[-1], first.q.shape[1], first.k.shape[1], first.q.shape[-1])
    return p, [{"params": [p.gate_weight], "lr": gate_lr},
               {"params": [p.ln_weight, p.ln_bias, p.log_tau_state, p.log_tau_window], "lr": lr}]


def _ovq_start(batches: list[LayerInputs], lr: float) -> tuple[OvqParameters, list[dict]]:
    """OVQ's beta at its closed form (OvqParameters.closed_form, mean over the batches) and its Adam group."""
    p = OvqParameters(torch.stack([OvqParameters.closed_form(b) for b in batches]).mean(0))
    return p, [{"params": [p.log_beta], "lr": lr}]


def fit_kvm_layer(batches: list[LayerInputs], setup: KvmSetup, *, steps: int, lr: float = 0.02,
                  gate_lr: float = 1e-3, on_step: Callable[[int, float], None] | None = None) -> LayerFit:
    """fit_layer for KVM from the neutral parameters: ``lr`` for the LayerNorm affine and the
    log-temperatures, ``gate_lr`` for W_g. Raises ValueError as fit_layer."""
    if not batches:
        raise ValueError("batches: no captured inputs to fit")
    p, groups = _kvm_start(batches, lr, gate_lr)
    return fit_layer(p, batches, setup, steps=steps, groups=groups, on_step=on_step)


def fit_ovq_layer(batches: list[LayerInputs], setup: OvqSetup, *, steps: int, lr: float = 0.05,
                  on_step: Callable[[int, float], None] | None = None) -> LayerFit:
    """fit_layer for OVQ from beta's closed form (OvqParameters.closed_form over the batches); ``lr`` for
    log beta. Raises ValueError as fit_layer."""
    if not batches:
        raise ValueError("batches: no captured inputs to fit")
    p, groups = _ovq_start(batches, lr)
    return fit_layer(p, batches, setup, steps=steps, groups=groups, on_step=on_step)


def fit_adapted_layer(model, layer_idx: int, batches: list[LayerInputs], setup, *, rank: int, steps: int,
                      adapter_lr: float = 1e-2, seed: int = 0,
                      on_step: Callable[[int, float], None] | None = None) -> LayerFit:
    """Stage 1 of the "distilled + adapters" variant for one layer: the memory's parameters (KVM from neutral
    with fit_kvm_layer's rates when ``setup`` is a KvmSetup, OVQ from beta's closed form with fit_ovq_layer's
    when it is an OvqSetup) and rank-``rank`` adapters on the layer's q and k projections
    (kvmem.adapters.LayerAdapters.initial, seeded ``seed`` + layer_idx; Adam rate ``adapter_lr``) fitted
    together to exact attention on ``batches``: each step runs attention module ``layer_idx`` of ``model``
    (frozen) again on the captured x and position embeddings with the adapters (model.memory_in_layer), the
    target is exact attention on the captured (unadapted) q, k, v. The tensors hold the memory's and the
    adapters' (kvmem.weights names). Leaves every parameter of ``model`` with requires_grad False (frozen), as
    fit_end_to_end does. Raises ValueError as fit_layer, for rank < 1, or for another setup."""
    from ..adapters import LayerAdapters
    from .model import memory_in_layer

    if steps < 0:
        raise ValueError(f"steps = {steps}: must be >= 0")
    if not batches:
        raise ValueError("batches: no captured inputs to fit")
    if isinstance(setup, KvmSetup):
        p, groups = _kvm_start(batches, 0.02, 1e-3)
    elif isinstance(setup, OvqSetup):
        p, groups = _ovq_start(batches, 0.05)
    else:
        raise ValueError(f"setup = {setup!r}: adapters are trained with KVM (KvmSetup) or OVQ (OvqSetup)")
    first = batches[0]
    D, hidden = first.q.shape[-1], first.x.shape[-1]
    a = LayerAdapters.initial(hidden, first.q.shape[1] * D, first.k.shape[1] * D, rank, seed=seed + layer_idx)
    groups.append({"params": list(a.parameters()), "lr": adapter_lr})
    for w in model.parameters():
        w.requires_grad_(False)
    targets = [exact_attention(b.q, b.k, b.v) for b in batches]
    with memory_in_layer(model, layer_idx, p, setup, a) as run:
        curve = _descend(torch.optim.Adam(groups), lambda: (relative_error(run(b), t) / len(batches)
                                                           for b, t in zip(batches, targets)), steps, on_step)
    return LayerFit(p.tensors() | a.tensors(), curve)


def model_shape(model, adapter_rank: int = 0) -> dict:
    """The sizes kvmem.weights records of a transformers model: layers, hidden, query_heads, kv_heads,
    head_dim, and ``adapter_rank`` (0: no adapters)."""
    c = model.config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "query_heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads, "head_dim": head_dim, "adapter_rank": adapter_rank}


def memory_weights(memory: str, model_name: str, model, layers: list[dict], metadata: dict | None = None):
    """kvmem.weights.MemoryWeights of ``memory`` ("kvm", "ovq" or "kvpop") for ``model`` (named ``model_name`` in the
    file) from one dict of tensors per layer, in layer order (with adapters when the layers hold them: the
    rank is q_adapter_down's rows). Raises ValueError as MemoryWeights.check."""
    from ..weights import MemoryWeights

    rank = layers[0]["q_adapter_down"].shape[0] if layers and "q_adapter_down" in layers[0] else 0
    w = MemoryWeights(memory, model_name, model_shape(model, rank), dict(enumerate(layers)), dict(metadata or {}))
    w.check(f"{memory} weights for {model_name}")
    return w


def parameters_of(memory: str, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """KvmParameters, OvqParameters or KvpopParameters (``memory`` "kvm", "ovq" or "kvpop") holding one
    layer's tensors."""
    if memory == "kvpop":
        H, X, h = tensors["w_q"].shape
        return KvpopParameters(H, 2 * h, X - 2 * h, tensors=tensors)
    return OvqParameters(tensors["beta"]) if memory == "ovq" else KvmParameters.from_tensors(tensors)


def fit_end_to_end(model, layers: list[torch.nn.Module], setup, sequences: list[torch.Tensor], *, steps: int,
                   lr: float = 0.005, adapters: list | None = None, adapter_lr: float = 2e-3,
                   on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Stage 2: the memories' parameters of every layer (``layers``, one module per attention layer, updated in
    place) and, when given, the layers' adapters (``adapters``, one kvmem.adapters.LayerAdapters per layer,
    Adam rate ``adapter_lr``, updated in place) trained end to end, ``model`` frozen: Adam on the KL
    divergence KL(p_full || p_memory) of the next-token distributions, mean over the positions of
    ``sequences`` (token ids [1, T] each), the full-cache model's distributions computed once. Returns the
    loss before each step and after the last (steps + 1 values). Raises ValueError for steps < 0 or no
    sequence, or as model.memories_in_every_layer."""
    from .model import memories_in_every_layer

    if steps < 0:
        raise ValueError(f"steps = {steps}: must be >= 0")
    if not sequences:
        raise ValueError("sequences: no text to train on")
    for p in model.parameters():
        p.requires_grad_(False)
    before = model.config._attn_implementation
    model.set_attn_implementation("sdpa")  # the teacher: the model with its full cache (exact attention)
    try:
        with torch.no_grad():
            teachers = [torch.log_softmax(model(ids, use_cache=False).logits.float(), -1) for ids in sequences]
    finally:
        model.set_attn_implementation(before)
    def kl(ids, teacher):
        student = torch.log_softmax(model(ids, use_cache=False).logits.float(), -1)
        return torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean()

    groups = [{"params": [p for layer in layers for p in layer.parameters()], "lr": lr}]
    if adapters:
        groups.append({"params": [p for a in adapters for p in a.parameters()], "lr": adapter_lr})
    opt = torch.optim.Adam(groups)
    with memories_in_every_layer(model, layers, setup, adapters):
        return _descend(opt, lambda: (kl(ids, t) / len(sequences) for ids, t in zip(sequences, teachers)), steps, on_step)
