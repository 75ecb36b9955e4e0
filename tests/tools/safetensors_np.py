"""Minimal safetensors reader/writer using only json + numpy.

Layout: 8-byte little-endian u64 header length N, N bytes of JSON header
({name: {"dtype", "shape", "data_offsets": [begin, end]}, optional "__metadata__"}),
then the raw little-endian tensor bytes. Offsets are relative to the data section.
"""
import json
import struct

import numpy as np

# numpy has no bfloat16: a BF16 tensor is an array of this one-field record, its 16 bits (bf16_round,
# bf16_to_f32 convert).
BF16 = np.dtype([("bfloat16_bits", "<u2")])
DTYPES = {"F32": np.dtype("<f4"), "F64": np.dtype("<f8"), "F16": np.dtype("<f2"), "BF16": BF16,
          "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I8": np.dtype("i1"), "U8": np.dtype("u1")}
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


def bf16_round(x):
    """float32 values of `x` rounded to bfloat16 (to nearest, ties to even: the high 16 bits of the float32
    after adding 0x7fff + the lowest kept bit), as a BF16 array. Finite inputs below bfloat16's largest
    value only (what the tests write)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
    return bits.view(BF16)


def bf16_to_f32(a):
    """The float32 values of a BF16 array (exact)."""
    return (np.ascontiguousarray(a).view("<u2").astype(np.uint32) << 16).view(np.float32)


def save(path, tensors, metadata=None):
    """Write {name: ndarray} to `path` (dtypes F32, F64, F16, BF16 (bf16_round), I64, I32, I8, U8 only)."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        dt = a.dtype.newbyteorder("<")
        if dt not in _NAMES:
            raise ValueError(f"{name}: unsupported dtype {a.dtype}")
        raw = np.ascontiguousarray(a, dtype=dt).tobytes()
        header[name] = {"dtype": _NAMES[dt], "shape": list(a.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # pad so the data section is 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for raw in blobs:
            f.write(raw)


def load(path):
    """Read a safetensors file into {name: ndarray}; raises ValueError if malformed."""
    with open(path, "rb") as f:
        buf = f.read()
    if len(buf) < 8:
        raise ValueError("file shorter than 8 bytes")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > MAX_HEADER or 8 + n > len(buf):
        raise ValueError(f"bad header length {n}")
    try:
        header = json.loads(buf[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"bad header JSON: {e}")
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header.pop("__metadata__", None)
    data = buf[8 + n:]
    out, spans = {}, []
    for name, info in header.items():
        try:
            dt = DTYPES[info["dtype"]]
            shape = [int(s) for s in info["shape"]]
            b, e = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as ex:
            raise ValueError(f"{name}: bad entry {info!r} ({ex})")
        if any(s < 0 for s in shape):
            raise ValueError(f"{name}: negative dimension in {shape}")
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= b <= e <= len(data) or e - b != count * dt.itemsize:
            raise ValueError(f"{name}: data_offsets {[b, e]} do not fit shape {shape} "
                             f"{info['dtype']} in {len(data)} data bytes")
        spans.append((b, e, name))
        out[name] = np.frombuffer(data[b:e], dtype=dt).reshape(shape).copy()
    pos = 0  # the data section must be covered exactly, without holes or overlaps
    for b, e, name in sorted(spans):
        if b != pos:
            raise ValueError(f"{name}: data_offsets start at {b}, expected {pos}")
        pos = e
    if pos != len(data):
        raise ValueError(f"data section has {len(data)} bytes, tensors cover {pos}")
    return out
