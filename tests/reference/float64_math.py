"""Small float64 NumPy helpers shared by the naive references: softmax, sigmoid, log-sigmoid (no overflow),
and dot products and norms rounded once (the same bits on every machine)."""

import math

import numpy as np


def softmax(z):
    """softmax over the last axis, max subtracted first."""
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def sigmoid(z):
    """1 / (1 + exp(-z)) without overflow."""
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def logsigmoid(z):
    """log(sigmoid(z)) without overflow."""
    z = np.asarray(z, dtype=np.float64)
    return np.minimum(z, 0.0) - np.log1p(np.exp(-np.abs(z)))


def fsum_dot(a, b):
    """a . b of two vectors with one rounding: math.fsum of the float64 products. BLAS and NumPy's SIMD sums
    add in an order that depends on the CPU, so a reference that decides a near-tie (a routing argmax, a
    lowest score) on their last bit decides it differently on different machines; this does not."""
    return math.fsum(np.asarray(a, dtype=np.float64) * np.asarray(b, dtype=np.float64))


def fsum_norm(x):
    """||x||_2 over the last axis (keepdims), each sum of squares rounded once (math.fsum)."""
    x = np.asarray(x, dtype=np.float64)
    flat = x.reshape(-1, x.shape[-1]) if x.shape[-1] else x.reshape(-1, 0)
    out = np.array([math.sqrt(math.fsum(r * r)) for r in flat])
    return out.reshape(x.shape[:-1] + (1,))
