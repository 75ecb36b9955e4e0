"""The torch.library ops kvmem::prefill and kvmem::decode: opcheck passes on each, and torch.compile
traces a model that calls them with no graph break (fullgraph=True)."""

import pytest
import torch

import kvmem

B, HQ, HKV, T, D = 1, 4, 2, 24, 16


def memory(dtype=torch.float32):
    return kvmem.EvictionMemory(D, HQ, HKV, batch=B, scorer="knorm", sinks=2, window=8, top_k=8, dtype=dtype)


@pytest.mark.parametrize("with_lse", [False, True], ids=["y", "y+lse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_opcheck(rand, op, dtype, with_lse):
    m = memory(dtype)
    tokens = T if op == "prefill" else 1
    q, k, v = rand(B, HQ, tokens, D).to(dtype), rand(B, HKV, tokens, D).to(dtype), rand(B, HKV, tokens, D).to(dtype)
    y = torch.empty(B, HQ, tokens, D, dtype=dtype)
    lse = torch.empty(B, HQ, tokens) if with_lse else None
    fn = getattr(torch.ops.kvmem, op).default
    if op == "decode":
        m.prefill(rand(B, HQ, T, D).to(dtype), rand(B, HKV, T, D).to(dtype), rand(B, HKV, T, D).to(dtype))
    torch.library.opcheck(fn, (m.handle, q, k, v, [], y, [], lse))


class Attention(torch.nn.Module):
    """A toy attention layer whose cache is a kvmem memory (what an engine's layer does)."""

    def __init__(self, mem):
        super().__init__()
        self.mem = mem
        self.proj = torch.nn.Linear(D, D, bias=False)

    def forward(self, q, k, v):
        y = torch.empty(q.shape[:-1] + (D,), dtype=q.dtype)
        torch.ops.kvmem.prefill(self.mem.handle, self.proj(q), k, v, [], y, [])
        return y * 2.0


def test_compile_fullgraph(rand):
    q, k, v = rand(B, HQ, T, D), rand(B, HKV, T, D), rand(B, HKV, T, D)
    eager_mem, compiled_mem = memory(), memory()
    torch.manual_seed(0)
    layer = Attention(eager_mem)
    with torch.no_grad():
        want = layer(q, k, v)
        layer.mem = compiled_mem
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        got = compiled(q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert compiled_mem.tokens(0) == T


def test_compile_decode_loop(rand):
    """A decode step compiled once runs token after token (the memory's handle is a constant)."""
    m_eager, m_comp = memory(), memory()
    q, k, v = rand(B, HQ, T, D), rand(B, HKV, T, D), rand(B, HKV, T, D)

    def step(handle, q1, k1, v1):
        y = torch.empty(B, HQ, 1, D)
        torch.ops.kvmem.decode(handle, q1, k1, v1, [], y, [])
        return y

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for s in range(T):
        i = slice(s, s + 1)
        torch.testing.assert_close(compiled(m_comp.handle, q[:, :, i], k[:, :, i], v[:, :, i]),
                                   step(m_eager.handle, q[:, :, i], k[:, :, i], v[:, :, i]), rtol=0, atol=0)
