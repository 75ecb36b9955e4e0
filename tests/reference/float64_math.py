"""Small float64 NumPy helpers shared by the naive references: softmax, sigmoid, log-sigmoid (no overflow)."""

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
