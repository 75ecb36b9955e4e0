"""The Python door gives the same bits as kvmem-run (the C++ memories driven from the command line) on
the same inputs, on the same backend: KVM (every budget, gate, learned weights, ragged batch), OVQ,
eviction with each scorer, Trellis; in float32 and with bfloat16 and float16 storage (the Python memory
takes torch's 16-bit tensors as they are, kvmem-run converts its float32 input with --dtype, both round to
nearest even)."""

import subprocess

import numpy as np
import pytest
import torch

import kvmem
import safetensors_np as stn


def run(kvmem_run, tmp_path, command, tensors, args, mode="prefill"):
    inp, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    stn.save(str(inp), {n: t.numpy() for n, t in tensors.items()})
    r = subprocess.run([kvmem_run, command, "--input", str(inp), "--output", str(out), "--mode", mode] + [str(a) for a in args],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return stn.load(str(out))


#: (torch dtype, kvmem-run's flags): the storage types a memory takes.
DTYPES = [(torch.float32, []), (torch.bfloat16, ["--dtype", "bf16"]), (torch.float16, ["--dtype", "f16"])]
DTYPE_IDS = ["f32", "bf16", "f16"]


def in_dtype(t, dtype, names):
    """The tensors `names` of `t` (token tensors) converted to `dtype` (round to nearest even)."""
    return {n: (x.to(dtype) if n in names else x) for n, x in t.items()}


def widened(a):
    """kvmem-run's output array (F32, BF16 or F16) as float32 values (exact)."""
    return stn.bf16_to_f32(a) if a.dtype == stn.BF16 else np.asarray(a, dtype=np.float32)


def assert_same_bits(y, want):
    """y (a torch tensor in the memory's dtype) has the bits of kvmem-run's array `want`."""
    if y.dtype == torch.float32:
        np.testing.assert_array_equal(y.numpy(), want)
    else:
        assert want.itemsize == 2
        np.testing.assert_array_equal(y.contiguous().view(torch.int16).numpy(), np.ascontiguousarray(want).view("<i2"))


KVM_BUDGETS = [
    (kvmem.budget.Fixed(12), ["--budget", "fixed", "--min-rows", 12]),
    (kvmem.budget.PowerLaw(8, 2.0, 0.5), ["--budget", "power-law", "--min-rows", 8, "--growth-factor", 2.0, "--growth-exponent", 0.5]),
    (kvmem.budget.Saturating(4, 20.0), ["--budget", "saturating", "--min-rows", 4, "--saturation-n", 20.0]),
    (kvmem.budget.Plateau(24.0), ["--budget", "plateau", "--plateau-n", 24.0]),
]


@pytest.mark.parametrize("dtype,dtype_flags", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("schedule,flags", KVM_BUDGETS, ids=lambda x: getattr(x, "kind", None))
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_kvm(kvmem_run, tmp_path, rand, schedule, flags, mode, dtype, dtype_flags):
    B, Hq, Hkv, T, D, C = 2, 4, 2, 45, 8, 4
    t = dict(q=rand(B, Hq, T, D), k=rand(B, Hkv, T, D), v=rand(B, Hkv, T, D), gate=rand(B, Hkv, T),
             ln_weight=1 + 0.2 * rand(D), ln_bias=0.1 * rand(D), tau_state=1 + 0.1 * rand(Hq), tau_bswa=1 + 0.1 * rand(Hq))
    t["lengths"] = torch.tensor([T, 31])
    want = run(kvmem_run, tmp_path, "kvm", t, ["--chunk", C, "--window-chunks", 2, "--rope-dims", 0, "--sinks", 1, "--max-chunks", 8]
               + flags + dtype_flags, mode)
    x = in_dtype(t, dtype, ("q", "k", "v", "gate"))
    m = kvmem.KvmMemory(D, Hq, Hkv, batch=B, chunk=C, window_chunks=2, sinks=1, max_rows=C * 8, budget=schedule,
                        ln_weight=t["ln_weight"], ln_bias=t["ln_bias"], tau_state=t["tau_state"], tau_window=t["tau_bswa"],
                        dtype=dtype)
    if mode == "prefill":
        y = m.prefill(x["q"], x["k"], x["v"], x["gate"], lengths=[T, 31])
    else:  # token by token, the second sequence stops after 31 tokens
        y = torch.zeros(B, Hq, T, D, dtype=dtype)
        for s in range(T):
            i = slice(s, s + 1)
            m.decode(x["q"][:, :, i], x["k"][:, :, i], x["v"][:, :, i], x["gate"][:, :, i], y=y[:, :, i], active=[True, s < 31])
    assert_same_bits(y, want["y"])
    state = m.state()
    want_rows = want["state_rows"]  # [B, Hkv]: every kv-head of a sequence holds the same number of rows
    for b in range(B):
        assert (want_rows[b] == state["rows"][b]).all()
        n = state["rows"][b]
        np.testing.assert_array_equal(state["keys"][b, :, :n].numpy(), widened(want["state_keys"])[b, :, :n])
        np.testing.assert_array_equal(state["values"][b, :, :n].numpy(), widened(want["state_values"])[b, :, :n])


@pytest.mark.parametrize("dtype,dtype_flags", DTYPES, ids=DTYPE_IDS)
def test_ovq(kvmem_run, tmp_path, rand, dtype, dtype_flags):
    B, H, T, D = 2, 3, 70, 8
    t = dict(q=rand(B, H, T, D), k=rand(B, H, T, D), v=rand(B, H, T, D), beta=1 + 0.1 * rand(H))
    want = run(kvmem_run, tmp_path, "ovq", t, ["--chunk", 8, "--max-centroids", 16] + dtype_flags)
    x = in_dtype(t, dtype, ("q", "k", "v"))
    m = kvmem.OvqMemory(D, H, batch=B, chunk=8, max_centroids=16, beta=t["beta"], dtype=dtype)
    assert_same_bits(m.prefill(x["q"], x["k"], x["v"]), want["y"])
    np.testing.assert_array_equal(m.state()["counts"].numpy()[..., : want["counts"].shape[-1]], want["counts"])


@pytest.mark.parametrize("dtype,dtype_flags", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scorer", ["streaming", "knorm", "h2o", "tova"])
def test_eviction(kvmem_run, tmp_path, rand, scorer, dtype, dtype_flags):
    B, Hq, Hkv, T, D = 2, 4, 2, 60, 8
    t = dict(q=rand(B, Hq, T, D), k=rand(B, Hkv, T, D), v=rand(B, Hkv, T, D), lengths=torch.tensor([60, 44]))
    want = run(kvmem_run, tmp_path, "evict", t, ["--sinks", 2, "--window", 8, "--top-k", 10, "--scorer", scorer] + dtype_flags)
    x = in_dtype(t, dtype, ("q", "k", "v"))
    m = kvmem.EvictionMemory(D, Hq, Hkv, batch=B, scorer=scorer, sinks=2, window=8, top_k=10, dtype=dtype)
    y = m.prefill(x["q"], x["k"], x["v"], lengths=[60, 44])
    assert_same_bits(y, want["y"])
    np.testing.assert_array_equal(m.state()["kept_rows"].numpy(), want["kept_rows"])


@pytest.mark.parametrize("dtype,dtype_flags", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_trellis(kvmem_run, tmp_path, rand, mode, dtype, dtype_flags):
    B, H, T, D, m_slots = 2, 2, 37, 8, 6
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)
    t = dict(q=unit(rand(B, H, T, D)), k=unit(rand(B, H, T, D)), v=unit(rand(B, H, T, D)), alpha=0.7 * rand(B, H, T, m_slots),
             beta1=torch.rand(B, H, T) * 0.4 + 0.6, gamma1=torch.rand(B, H, T) * 0.5, beta2=torch.rand(B, H, T) * 0.4 + 0.6,
             gamma2=torch.rand(B, H, T) * 0.5)
    want = run(kvmem_run, tmp_path, "trellis", t, ["--slots", m_slots, "--chunk", 8, "--phi", "silu", "--f", "ln-silu"]
               + dtype_flags, mode)
    names = ("alpha", "beta1", "gamma1", "beta2", "gamma2")
    x = in_dtype(t, dtype, ("q", "k", "v") + names)
    mem = kvmem.TrellisMemory(m_slots, D, H, batch=B, chunk=8, phi="silu", f="ln-silu", dtype=dtype)
    extras = [x[n] for n in names]
    if mode == "prefill":
        y = mem.prefill(x["q"], x["k"], x["v"], *extras)
    else:
        y = torch.cat([mem.decode(x["q"][:, :, s:s + 1], x["k"][:, :, s:s + 1], x["v"][:, :, s:s + 1],
                                  *[e[:, :, s:s + 1] for e in extras]) for s in range(T)], dim=2)
    assert_same_bits(y, want["y"])
    np.testing.assert_array_equal(mem.state()["m1"].numpy(), widened(want["m1"]))


@pytest.mark.parametrize("dtype,dtype_flags", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("normalizer", ["xlstm", "plain"])
def test_eviction_kvpop(kvmem_run, tmp_path, rand, normalizer, dtype, dtype_flags):
    """KVPOP's learned mLSTM scorer: weights given as a dict of tensors (copied at construction), the
    same as kvmem-run --weights on the same values."""
    B, Hq, Hkv, T, D = 2, 4, 2, 50, 8
    h, X = D // 2, 2 * D
    shapes = dict(w_q=(Hkv, X, h), w_k=(Hkv, X, h), w_v=(Hkv, X, h), w_i=(Hkv, X), b_i=(Hkv,), w_f=(Hkv, X), b_f=(Hkv,),
                  w_s=(Hkv, h), b_s=(Hkv,))
    weights = {n: 0.3 * rand(*sh) for n, sh in shapes.items()}
    weights["b_f"] += 2.0
    weights["theta"] = torch.tensor([-8.0, 4.0])
    stn.save(str(tmp_path / "w.safetensors"), {n: t.numpy() for n, t in weights.items()})
    t = dict(q=rand(B, Hq, T, D), k=rand(B, Hkv, T, D), v=rand(B, Hkv, T, D))
    want = run(kvmem_run, tmp_path, "evict", t, ["--sinks", 2, "--window", 6, "--top-k", 8, "--scorer", "kvpop", "--weights",
                                                 tmp_path / "w.safetensors", "--decay-interval", 2, "--normalizer", normalizer]
               + dtype_flags)
    x = in_dtype(t, dtype, ("q", "k", "v"))
    m = kvmem.EvictionMemory(D, Hq, Hkv, batch=B, scorer="kvpop", sinks=2, window=6, top_k=8, decay_interval=2,
                             weights=weights, normalizer=normalizer, dtype=dtype)
    assert_same_bits(m.prefill(x["q"], x["k"], x["v"]), want["y"])
    np.testing.assert_array_equal(m.state()["kept_rows"].numpy(), want["kept_rows"])
