#!/usr/bin/env python3
"""Writes the committed seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/), deterministically.

    python3 tests/fuzz/make_corpus.py          # rewrite tests/fuzz/corpus/

corpus/safetensors/: valid files of every dtype and broken or malicious ones (header length past the end
of the file, offsets past the end, overlapping tensors, shapes whose byte count overflows 64 bits,
non-UTF-8 names, deep JSON, ...). corpus/kvm_input/: valid kvmem-run inputs with their flags in
"__metadata__" (see fuzz_kvm_input.cpp), the same inputs with one tensor broken, and the malicious
headers. Every file stays under 4 KiB, libFuzzer's default input size.
"""
import json
import os
import shutil
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
import safetensors_np  # noqa: E402

F32 = np.float32


def raw(header, data=b"", header_len=None):
    """A safetensors file from a header (dict, or str/bytes taken verbatim) and data bytes."""
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    if isinstance(header, str):
        header = header.encode()
    n = len(header) if header_len is None else header_len
    return struct.pack("<Q", n) + header + data


def st(tensors, metadata=None):
    """Bytes of a well-formed file of {name: ndarray}."""
    path = os.path.join(OUT_TMP, "t.safetensors")
    safetensors_np.save(path, tensors, metadata)
    with open(path, "rb") as f:
        return f.read()


def kvm_tensors(B=1, Hq=2, Hkv=1, T=20, D=4, Dv=3, seed=0, lengths=None, dtype=F32):
    rng = np.random.default_rng(seed)
    t = {"q": rng.standard_normal((B, Hq, T, D)), "k": rng.standard_normal((B, Hkv, T, D)),
         "v": rng.standard_normal((B, Hkv, T, Dv)), "gate": rng.uniform(-2, 2, (B, Hkv, T)),
         "ln_weight": 1 + 0.2 * rng.standard_normal(D), "ln_bias": 0.1 * rng.standard_normal(D),
         "tau_state": rng.uniform(0.7, 1.3, Hq), "tau_bswa": rng.uniform(0.7, 1.3, Hq)}
    t = {n: a.astype(dtype) for n, a in t.items()}
    if lengths is not None:
        t["lengths"] = np.array(lengths[0], dtype=lengths[1])
    return t


def safetensors_seeds():
    a = np.arange(6, dtype=F32).reshape(2, 3)
    yield "valid-f32-with-metadata", st({"a": a}, {"source": "seed", "n": "1"})
    yield "valid-every-numeric-dtype", st({"f64": np.linspace(0, 1, 3), "i64": np.array([1, -2], np.int64),
                                          "i32": np.array([3], np.int32), "f32": np.zeros((2, 0), F32)})
    data = bytes(range(16))
    yield "valid-other-dtypes", raw({"h": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
                                     "b": {"dtype": "BF16", "shape": [1, 2], "data_offsets": [4, 8]},
                                     "u": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]},
                                     "z": {"dtype": "BOOL", "shape": [2], "data_offsets": [12, 14]},
                                     "c": {"dtype": "I8", "shape": [], "data_offsets": [14, 15]},
                                     "s": {"dtype": "I16", "shape": [0], "data_offsets": [15, 15]}}, data[:15])
    yield "valid-empty-header", raw("{}")
    yield "valid-scalar", raw({"x": {"dtype": "F64", "shape": [], "data_offsets": [0, 8]}}, struct.pack("<d", 2.5))
    yield "valid-zero-dim-then-huge", raw({"x": {"dtype": "F32", "shape": [0, 4611686018427387904],
                                                 "data_offsets": [0, 0]}})
    yield "valid-escaped-names", raw('{"a\\u0000b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                                     '"\\u00e9\\ud83d\\ude00":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"xy")
    yield "bad-too-short", b"\x05\x00\x00"
    yield "bad-header-length-past-end", raw("{}", header_len=1000)
    yield "bad-header-length-max", raw("{}", header_len=2**64 - 1)
    yield "bad-header-not-json", raw("{not json")
    yield "bad-header-array", raw("[1,2,3]")
    yield "bad-header-truncated-json", raw('{"a":{"dtype":"F32","sha')
    yield "bad-offsets-past-end", raw({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    yield "bad-offsets-reversed", raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}, b"\0" * 8)
    yield "bad-offsets-huge", raw({"a": {"dtype": "U8", "shape": [1],
                                         "data_offsets": [18446744073709551615, 18446744073709551615]}}, b"\0")
    yield "bad-offsets-three", raw({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}}, b"\0")
    yield "bad-offsets-negative", raw({"a": {"dtype": "U8", "shape": [1], "data_offsets": [-1, 0]}}, b"\0")
    yield "bad-offsets-float", raw({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0.0, 1.0]}}, b"\0")
    yield "bad-overlapping", raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                  "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12)
    yield "bad-contained", raw({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
                                "b": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}, b"\0" * 8)
    yield "bad-shape-overflow", raw({"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 16],
                                           "data_offsets": [0, 0]}})
    yield "bad-shape-bytes-overflow", raw({"a": {"dtype": "F64", "shape": [2305843009213693952],
                                                 "data_offsets": [0, 0]}})
    yield "bad-shape-too-big-for-int64", raw({"a": {"dtype": "F32", "shape": [0, 18446744073709551615],
                                                    "data_offsets": [0, 0]}})
    yield "bad-shape-mismatch", raw({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8)
    yield "bad-shape-negative", raw({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}})
    yield "bad-shape-float", raw({"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}, b"\0" * 4)
    yield "bad-shape-string", raw({"a": {"dtype": "F32", "shape": "[1]", "data_offsets": [0, 4]}}, b"\0" * 4)
    yield "bad-dtype-unknown", raw({"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\0")
    yield "bad-dtype-not-string", raw({"a": {"dtype": 4, "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    yield "bad-entry-missing-fields", raw({"a": {"dtype": "F32"}})
    yield "bad-entry-not-object", raw({"a": [1, 2]})
    yield "bad-name-not-utf8", raw(b'{"\xff\xfe":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\0")
    yield "bad-name-overlong-utf8", raw(b'{"\xc0\xaf":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\0")
    yield "bad-name-lone-surrogate", raw('{"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\0")
    yield "bad-metadata-not-utf8", raw(b'{"__metadata__":{"k":"\xff"}}')
    yield "bad-metadata-not-object", raw({"__metadata__": ["x"]})
    yield "bad-metadata-value-not-string", raw({"__metadata__": {"k": 1}})
    yield "bad-deep-json", raw('{"a":{"dtype":"F32","shape":' + "[" * 300 + "]" * 300 + ',"data_offsets":[0,0]}}')
    yield "bad-duplicate-names", raw('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                                     '"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}', b"\0\0")


def kvm_seeds():
    T = kvm_tensors
    md = lambda **kw: {k: str(v) for k, v in kw.items()}  # noqa: E731
    yield "valid-prefill-fixed", st(T(), md(mode="prefill", budget="fixed", chunk=4, window_chunks=2, sinks=1))
    yield "valid-decode-fixed", st(T(seed=1), md(mode="decode", budget="fixed", chunk=4, window_chunks=2, sinks=1))
    yield "valid-prefill-power-law-ragged", st(
        T(B=2, T=18, seed=2, lengths=([18, 7], np.int64)),
        md(mode="prefill", budget="power-law", chunk=2, window_chunks=2, sinks=1, min_rows=2, growth_factor=2.0,
           max_chunks=8))
    yield "valid-decode-power-law-ragged", st(
        T(B=2, T=18, seed=3, lengths=([0, 18], np.int32)),
        md(mode="decode", budget="power-law", chunk=2, window_chunks=3, sinks=0, min_rows=-1, growth_factor=1.5,
           growth_exponent=0.6, round_down=2, max_chunks=100))
    yield "valid-saturating-f64", st(T(Hq=2, Hkv=2, T=16, seed=4, dtype=np.float64),
                                     md(mode="decode", budget="saturating", chunk=3, window_chunks=1, sinks=1,
                                        saturation_n=8, min_rows=1, max_chunks=10, rope_dims=2))
    yield "valid-chunk-1", st(T(T=12, seed=5), md(mode="prefill", budget="power-law", chunk=1, window_chunks=1,
                                                  sinks=0, growth_factor=4.0, max_chunks=1000))
    yield "valid-gqa-rope", st(T(Hq=4, Hkv=2, T=10, D=4, seed=6),
                               md(mode="prefill", chunk=2, window_chunks=2, rope_dims=4, sinks=1, min_rows=3))
    yield "valid-one-token", st(T(T=1, seed=7), md(mode="decode", chunk=4))
    base = kvm_tensors(seed=8)

    def edit(**changes):
        x = dict(base)
        for k, v in changes.items():
            if v is None:
                del x[k]
            else:
                x[k] = v
        return st(x, md(mode="prefill", chunk=4))
    yield "bad-gate-missing", edit(gate=None)
    yield "bad-q-rank-3", edit(q=base["q"][0])
    yield "bad-k-other-T", edit(k=base["k"][:, :, :5])
    yield "bad-v-other-heads", edit(v=np.zeros((1, 2, 20, 3), F32))
    yield "bad-hq-not-multiple", edit(k=np.zeros((1, 3, 20, 4), F32), v=np.zeros((1, 3, 20, 3), F32),
                                      gate=np.zeros((1, 3, 20), F32))
    yield "bad-ln-weight-size", edit(ln_weight=np.ones(5, F32))
    yield "bad-q-int32", edit(q=base["q"].astype(np.int32))
    yield "bad-lengths-too-long", edit(lengths=np.array([21], np.int64))
    yield "bad-lengths-negative", edit(lengths=np.array([-5], np.int64))
    yield "bad-lengths-float", edit(lengths=np.array([3], F32))
    yield "bad-lengths-shape", edit(lengths=np.array([[3]], np.int64))
    yield "bad-flags-chunk-negative", st(base, md(chunk=-1))
    yield "bad-flags-sinks-ge-chunk", st(base, md(chunk=2, sinks=2))
    yield "bad-flags-budget", st(base, md(budget="cubic"))
    yield "bad-flags-growth-factor-nan", st(base, md(budget="power-law", growth_factor="nan"))
    yield "bad-flags-round-down-zero", st(base, md(budget="saturating", round_down=0))
    yield "bad-flags-rope-dims", st(base, md(rope_dims=5))
    cut = st(base, md(mode="prefill"))
    yield "bad-data-cut-short", cut[:-9]
    n = struct.unpack("<Q", cut[:8])[0]
    yield "bad-header-cut", cut[: 8 + n // 2]


def main():
    out = os.path.join(HERE, "corpus")
    global OUT_TMP
    OUT_TMP = os.path.join(out, ".tmp")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(OUT_TMP)
    seeds = {"safetensors": list(safetensors_seeds()), "kvm_input": list(kvm_seeds())}
    seeds["kvm_input"] += [(n, b) for n, b in seeds["safetensors"] if n.startswith("bad-")]
    for target, files in seeds.items():
        os.makedirs(os.path.join(out, target))
        for name, data in files:
            assert len(data) <= 4096, (name, len(data))
            with open(os.path.join(out, target, name), "wb") as f:
                f.write(data)
        print(f"{target}: {len(files)} seeds")
    shutil.rmtree(OUT_TMP)


OUT_TMP = None
if __name__ == "__main__":
    main()
