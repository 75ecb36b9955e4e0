"""Argument checks shared by the training forms (kvmem.train.ovq, kvmem.train.kvpop)."""
from __future__ import annotations

import operator


def count(name: str, value, low: int) -> int:
    """An integer argument >= low: raises TypeError for a non-integer (bool included) and ValueError below
    low, naming the argument and its value."""
    if isinstance(value, bool):
        raise TypeError(f"{name} = {value!r}: must be an int")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} = {value!r}: must be an int") from None
    if n < low:
        raise ValueError(f"{name} = {n}: must be >= {low}")
    return n
