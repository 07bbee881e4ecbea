"""The swarm-wide round clock.

Rounds happen at wall-clock (DHT) times, not at local step counts, so islands of different speeds
meet in the same round without a central syncer: fragment p's k-th round is at
``t0 + (k + p / P) * T_outer`` with t0 = 0 (the Unix epoch). Fragments are staggered by T_outer / P,
so one fragment is in flight at a time and peak bandwidth is 1/P of plain DiLoCo
(Streaming DiLoCo, arXiv 2501.18512, Sec. 2.1; docs/DESIGN.md, "When rounds happen").

With G groups that take turns (docs/DESIGN.md, "Groups that take turns"), fragment p's slots come G
times as often, ``t0 + (k + p / P) * T_outer / G``, and slot k belongs to group k mod G: each island
still rounds once per T_outer, in its group's slots.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional
from dataclasses import dataclass


@dataclass(frozen=True)
class RoundSlot:
    """One round: fragment ``fragment``'s ``index``-th slot at ``time`` (seconds since the epoch)."""

    time: float
    fragment: int
    index: int


@dataclass(frozen=True)
class RoundClock:
    """Slot times of every fragment for an outer period of ``period`` seconds, ``num_fragments`` P and
    ``groups`` G taking turns (1: every island in every slot).

    :raises ValueError: period <= 0, or P or G below 1
    """

    period: float
    num_fragments: int
    groups: int = 1

    def __post_init__(self):
        if self.period <= 0 or self.num_fragments < 1 or self.groups < 1:
            raise ValueError("period must be > 0, num_fragments and groups >= 1")

    @property
    def spacing(self) -> float:
        """Seconds between two consecutive slots of one fragment (T_outer / G)."""
        return self.period / self.groups

    def slot_time(self, fragment: int, index: int) -> float:
        """Wall-clock time of fragment ``fragment``'s round ``index``."""
        return (index + fragment / self.num_fragments) * self.spacing

    def next_slot(self, fragment: int, after: float, group: Optional[int] = None) -> RoundSlot:
        """The first slot of ``fragment`` strictly later than ``after`` (that belongs to ``group``:
        index mod G, when given)."""
        index = math.floor(after / self.spacing - fragment / self.num_fragments) + 1
        while self.slot_time(fragment, index) <= after:
            index += 1
        while index > 0 and self.slot_time(fragment, index - 1) > after:
            index -= 1
        if group is not None:
            index += (group - index) % self.groups
        return RoundSlot(self.slot_time(fragment, index), fragment, index)


def turn_group(island: str, live: Iterable[str], groups: int) -> int:
    """The group (0 to G - 1) whose slots ``island`` takes: its index among the sorted names of
    itself and the other live islands ``live``, mod G, so that groups differ in size by at most one
    island (docs/DESIGN.md, "Groups that take turns"). Islands that read different live sets may
    disagree; that makes one group larger for a period, never a fork (each slot's group reloads the
    swarm's newest state first)."""
    return sorted({island, *live}).index(island) % groups
