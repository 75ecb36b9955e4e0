"""The Python door gives the same bits as kvmem-run (the C++ memories driven from the command line) on
the same inputs, on the same backend: KVM (every budget, gate, learned weights, ragged batch), OVQ,
eviction with each scorer, Trellis."""

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


KVM_BUDGETS = [
    (kvmem.budget.Fixed(12), ["--budget", "fixed", "--min-rows", 12]),
    (kvmem.budget.PowerLaw(8, 2.0, 0.5), ["--budget", "power-law", "--min-rows", 8, "--growth-factor", 2.0, "--growth-exponent", 0.5]),
    (kvmem.budget.Saturating(4, 20.0), ["--budget", "saturating", "--min-rows", 4, "--saturation-n", 20.0]),
    (kvmem.budget.Plateau(24.0), ["--budget", "plateau", "--plateau-n", 24.0]),
]


@pytest.mark.parametrize("schedule,flags", KVM_BUDGETS, ids=lambda x: getattr(x, "kind", None))
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_kvm(kvmem_run, tmp_path, rand, schedule, flags, mode):
    B, Hq, Hkv, T, D, C = 2, 4, 2, 45, 8, 4
    t = dict(q=rand(B, Hq, T, D), k=rand(B, Hkv, T, D), v=rand(B, Hkv, T, D), gate=rand(B, Hkv, T),
             ln_weight=1 + 0.2 * rand(D), ln_bias=0.1 * rand(D), tau_state=1 + 0.1 * rand(Hq), tau_bswa=1 + 0.1 * rand(Hq))
    t["lengths"] = torch.tensor([T, 31])
    want = run(kvmem_run, tmp_path, "kvm", t, ["--chunk", C, "--window-chunks", 2, "--rope-dims", 0, "--sinks", 1, "--max-chunks", 8] + flags, mode)
    m = kvmem.KvmMemory(D, Hq, Hkv, batch=B, chunk=C, window_chunks=2, sinks=1, max_rows=C * 8, budget=schedule,
                        ln_weight=t["ln_weight"], ln_bias=t["ln_bias"], tau_state=t["tau_state"], tau_window=t["tau_bswa"])
    if mode == "prefill":
        y = m.prefill(t["q"], t["k"], t["v"], t["gate"], lengths=[T, 31])
    else:  # token by token, the second sequence stops after 31 tokens
        y = torch.zeros(B, Hq, T, D)
        for s in range(T):
            i = slice(s, s + 1)
            m.decode(t["q"][:, :, i], t["k"][:, :, i], t["v"][:, :, i], t["gate"][:, :, i], y=y[:, :, i], active=[True, s < 31])
    np.testing.assert_array_equal(y.numpy(), want["y"])
    state = m.state()
    want_rows = want["state_rows"]  # [B, Hkv]: every kv-head of a sequence holds the same number of rows
    for b in range(B):
        assert (want_rows[b] == state["rows"][b]).all()
        n = state["rows"][b]
        np.testing.assert_array_equal(state["keys"][b, :, :n].numpy(), want["state_keys"][b, :, :n])
        np.testing.assert_array_equal(state["values"][b, :, :n].numpy(), want["state_values"][b, :, :n])


def test_ovq(kvmem_run, tmp_path, rand):
    B, H, T, D = 2, 3, 70, 8
    t = dict(q=rand(B, H, T, D), k=rand(B, H, T, D), v=rand(B, H, T, D), beta=1 + 0.1 * rand(H))
    want = run(kvmem_run, tmp_path, "ovq", t, ["--chunk", 8, "--max-centroids", 16])
    m = kvmem.OvqMemory(D, H, batch=B, chunk=8, max_centroids=16, beta=t["beta"])
    np.testing.assert_array_equal(m.prefill(t["q"], t["k"], t["v"]).numpy(), want["y"])
    np.testing.assert_array_equal(m.state()["counts"].numpy()[..., : want["counts"].shape[-1]], want["counts"])


@pytest.mark.parametrize("scorer", ["streaming", "knorm", "h2o", "tova"])
def test_eviction(kvmem_run, tmp_path, rand, scorer):
    B, Hq, Hkv, T, D = 2, 4, 2, 60, 8
    t = dict(q=rand(B, Hq, T, D), k=rand(B, Hkv, T, D), v=rand(B, Hkv, T, D), lengths=torch.tensor([60, 44]))
    want = run(kvmem_run, tmp_path, "evict", t, ["--sinks", 2, "--window", 8, "--top-k", 10, "--scorer", scorer])
    m = kvmem.EvictionMemory(D, Hq, Hkv, batch=B, scorer=scorer, sinks=2, window=8, top_k=10)
    y = m.prefill(t["q"], t["k"], t["v"], lengths=[60, 44])
    np.testing.assert_array_equal(y.numpy(), want["y"])
    np.testing.assert_array_equal(m.state()["kept_rows"].numpy(), want["kept_rows"])


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_trellis(kvmem_run, tmp_path, rand, mode):
    B, H, T, D, m_slots = 2, 2, 37, 8, 6
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)
    t = dict(q=unit(rand(B, H, T, D)), k=unit(rand(B, H, T, D)), v=unit(rand(B, H, T, D)), alpha=0.7 * rand(B, H, T, m_slots),
             beta1=torch.rand(B, H, T) * 0.4 + 0.6, gamma1=torch.rand(B, H, T) * 0.5, beta2=torch.rand(B, H, T) * 0.4 + 0.6,
             gamma2=torch.rand(B, H, T) * 0.5)
    want = run(kvmem_run, tmp_path, "trellis", t, ["--slots", m_slots, "--chunk", 8, "--phi", "silu", "--f", "ln-silu"], mode)
    mem = kvmem.TrellisMemory(m_slots, D, H, batch=B, chunk=8, phi="silu", f="ln-silu")
    extras = [t[n] for n in ("alpha", "beta1", "gamma1", "beta2", "gamma2")]
    if mode == "prefill":
        y = mem.prefill(t["q"], t["k"], t["v"], *extras)
    else:
        y = torch.cat([mem.decode(t["q"][:, :, s:s + 1], t["k"][:, :, s:s + 1], t["v"][:, :, s:s + 1],
                                  *[x[:, :, s:s + 1] for x in extras]) for s in range(T)], dim=2)
    np.testing.assert_array_equal(y.numpy(), want["y"])
    np.testing.assert_array_equal(mem.state()["m1"].numpy(), want["m1"])


@pytest.mark.parametrize("normalizer", ["xlstm", "plain"])
def test_eviction_kvpop(kvmem_run, tmp_path, rand, normalizer):
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
                                                 tmp_path / "w.safetensors", "--decay-interval", 2, "--normalizer", normalizer])
    m = kvmem.EvictionMemory(D, Hq, Hkv, batch=B, scorer="kvpop", sinks=2, window=6, top_k=8, decay_interval=2,
                             weights=weights, normalizer=normalizer)
    np.testing.assert_array_equal(m.prefill(t["q"], t["k"], t["v"]).numpy(), want["y"])
    np.testing.assert_array_equal(m.state()["kept_rows"].numpy(), want["kept_rows"])
