"""Budget schedules of the merging memories (KVM, OVQ): how many state rows a sequence may hold after
ctx tokens (kvmem::budget in include/kvmem/policy/budget/; spec KVM.md §5.2, OVQ.md §3). Every count
is in state rows; the schedules are checked by the C++ constructor (a bad value raises ValueError naming
the field). ``rows(ctx)`` gives B(ctx) with the C++ arithmetic (the training forms of kvmem.train use it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

_PAST_LONG = 9223372036854775808.0  # 2^63


def _round_down(floored: float, multiple: int) -> int:
    """rd(x) of spec KVM.md §5.2 for an already floored x: floor(max(x, 0) / R) * R, saturating at 2^63 - 1
    and reading NaN as 0, as kvmem::budget::detail::round_down does."""
    x = (int(floored) if floored < _PAST_LONG else 2**63 - 1) if floored > 0.0 else 0
    return x // multiple * multiple


@dataclass(frozen=True)
class Fixed:
    """A fixed row budget: ``min_rows`` rows whatever the context (-1: the first chunk's size)."""

    min_rows: int = -1
    kind = "fixed"

    def rows(self, ctx: int) -> int:
        """B(ctx) in rows, as kvmem::budget::Fixed::rows: ``min_rows`` whatever ``ctx`` (tokens)."""
        return int(self.min_rows)


@dataclass(frozen=True)
class PowerLaw:
    """KVM's growing budget max(min_rows, growth_factor * ctx ** growth_exponent), rounded down to a
    multiple of ``round_down`` rows (spec KVM.md §5.2; the paper's 16 * sqrt(ctx) is growth_factor=16)."""

    min_rows: int = -1
    growth_factor: float = 1.0
    growth_exponent: float = 0.5
    round_down: int = 1
    kind = "power-law"

    def rows(self, ctx: int) -> int:
        """B(ctx) in rows after ``ctx`` tokens, in double as kvmem::budget::PowerLaw::rows (exponent 0.5 takes
        the correctly rounded square root, so exact squares give exact budgets)."""
        c = float(ctx)
        grown = math.sqrt(c) if self.growth_exponent == 0.5 else c ** float(self.growth_exponent)
        return max(_round_down(math.floor(float(self.growth_factor) * grown), int(self.round_down)), int(self.min_rows))


@dataclass(frozen=True)
class Saturating:
    """max(min_rows, saturation_n * ctx / (saturation_n + ctx)) rows, rounded down to ``round_down``."""

    min_rows: int = -1
    saturation_n: float = 1024.0
    round_down: int = 1
    kind = "saturating"

    def rows(self, ctx: int) -> int:
        """B(ctx) in rows after ``ctx`` tokens, in double as kvmem::budget::Saturating::rows."""
        c, n = float(ctx), float(self.saturation_n)
        return max(_round_down(math.floor((n * c) / (n + c)), int(self.round_down)), int(self.min_rows))


@dataclass(frozen=True)
class Plateau:
    """OVQ's t * N / (t + N) rows, approaching N (ovq-paper Sec. 3.2; spec OVQ.md §3)."""

    n: float = 1024.0
    kind = "plateau"

    def rows(self, ctx: int) -> int:
        """floor(ctx * N / (ctx + N)) rows after ``ctx`` tokens, as kvmem::budget::Plateau::rows."""
        return Saturating(-1, self.n, 1).rows(ctx)


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
