"""The swarm-wide round clock.

Rounds happen at wall-clock (DHT) times, not at local step counts, so islands of different speeds
meet in the same round without a central syncer: fragment p's k-th round is at
``t0 + (k + p / P) * T_outer`` with t0 = 0 (the Unix epoch). Fragments are staggered by T_outer / P,
so one fragment is in flight at a time and peak bandwidth is 1/P of plain DiLoCo
(Streaming DiLoCo, arXiv 2501.18512, Sec. 2.1; docs/DESIGN.md, "When rounds happen").
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RoundSlot:
    """One round: fragment ``fragment``'s ``index``-th slot at ``time`` (seconds since the epoch)."""

    time: float
    fragment: int
    index: int


@dataclass(frozen=True)
class RoundClock:
    """Slot times of every fragment for an outer period of ``period`` seconds and ``num_fragments`` P."""

    period: float
    num_fragments: int

    def __post_init__(self):
        if self.period <= 0 or self.num_fragments < 1:
            raise ValueError("period must be > 0 and num_fragments >= 1")

    def slot_time(self, fragment: int, index: int) -> float:
        """Wall-clock time of fragment ``fragment``'s round ``index``."""
        return (index + fragment / self.num_fragments) * self.period

    def next_slot(self, fragment: int, after: float) -> RoundSlot:
        """The first slot of ``fragment`` strictly later than ``after``."""
        index = math.floor(after / self.period - fragment / self.num_fragments) + 1
        while self.slot_time(fragment, index) <= after:
            index += 1
        while index > 0 and self.slot_time(fragment, index - 1) > after:
            index -= 1
        return RoundSlot(self.slot_time(fragment, index), fragment, index)
