"""Budget schedules of the merging memories (KVM, OVQ): how many state rows a sequence may hold after
ctx tokens (kvmem::budget in include/kvmem/policy/budget/; spec KVM.md §5.2, OVQ.md §3). Every count
is in state rows; the schedules are checked by the C++ constructor (a bad value raises ValueError naming
the field)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fixed:
    """A fixed row budget: ``min_rows`` rows whatever the context (-1: the first chunk's size)."""

    min_rows: int = -1
    kind = "fixed"


@dataclass(frozen=True)
class PowerLaw:
    """KVM's growing budget max(min_rows, growth_factor * ctx ** growth_exponent), rounded down to a
    multiple of ``round_down`` rows (spec KVM.md §5.2; the paper's 16 * sqrt(ctx) is growth_factor=16)."""

    min_rows: int = -1
    growth_factor: float = 1.0
    growth_exponent: float = 0.5
    round_down: int = 1
    kind = "power-law"


@dataclass(frozen=True)
class Saturating:
    """max(min_rows, saturation_n * ctx / (saturation_n + ctx)) rows, rounded down to ``round_down``."""

    min_rows: int = -1
    saturation_n: float = 1024.0
    round_down: int = 1
    kind = "saturating"


@dataclass(frozen=True)
class Plateau:
    """OVQ's t * N / (t + N) rows, approaching N (ovq-paper Sec. 3.2; spec OVQ.md §3)."""

    n: float = 1024.0
    kind = "plateau"


Schedule = Fixed | PowerLaw | Saturating | Plateau


def to_args(schedule: Schedule, native) -> object:
    """The C++ BudgetArgs of ``schedule``; raises TypeError for anything that is not a schedule."""
    if not isinstance(schedule, (Fixed, PowerLaw, Saturating, Plateau)):
        raise TypeError(f"budget = {schedule!r}: must be kvmem.budget.Fixed, PowerLaw, Saturating or Plateau")
    args = native.BudgetArgs()
    args.kind = schedule.kind
    for field in ("min_rows", "growth_factor", "growth_exponent", "round_down", "saturation_n"):
        if hasattr(schedule, field):
            setattr(args, field, getattr(schedule, field))
    if isinstance(schedule, Plateau):
        args.plateau_n = schedule.n
    return args
