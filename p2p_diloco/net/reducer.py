"""What a member does with the parts it reduces (docs/DESIGN.md, "Faulty and malicious members"):
in hivemind's all-reduce each member reduces a share of every member's vector. Here the weights it
uses are the members' gathered claims, capped (:func:`p2p_diloco.algo.robust.cap_weights`), never the
weight a sender writes into its messages; the merge of each part (:func:`merge_points`) is the weighted
mean or CenteredClip (:func:`p2p_diloco.algo.robust.centered_clip`, BTARD's ButterflyClip, arXiv
2106.11257, Sec. 3.1) without the senders that are far off; and the reducer notes, per member, in how
many of its parts the member was an outlier (its distance to the robust center over the median
distance), which the island reads as evidence.

hivemind builds one ``AllReduceRunner`` per round, and the runner one ``TensorPartReducer``. In the
averager process only, :func:`install_runner` makes hivemind's averager build
:class:`RobustAllReduceRunner` (a subclass that takes one more keyword, ``merge``, and is hivemind's
runner without it), and the runner builds a :class:`RobustPartReducer` (a subclass that collects the
parts of the current part index instead of summing them).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from p2p_diloco.algo import robust

logger = logging.getLogger(__name__)

MAX_MEMBERS = 64  # rows of the outlier book: members of one group beyond it go unrecorded
MIN_WEIGHT = 1e-12  # a reducer weight never falls below it (listeners: a mean of zero weights is 0/0)


@dataclass(frozen=True)
class MergeRule:
    """How a run's reducers merge parts; the same for every member (the run's fingerprint covers it).

    :param aggregator: ``mean`` (the weighted mean) or ``centered_clip``
    :param weight_cap: no member weighs more than this many times the lower median weight
    :param radius_factor: CenteredClip's tau over the median distance to the coordinate-wise median
    :param outlier_ratio: a member whose distance to the center is above this many times the median
        distance is an outlier in that part (and left out of it)
    """

    aggregator: str = "centered_clip"
    weight_cap: float = 1.5
    radius_factor: float = 2.0
    outlier_ratio: float = 4.0

    def __post_init__(self):
        if self.aggregator not in robust.AGGREGATORS:
            raise ValueError(f"aggregator must be one of {robust.AGGREGATORS}, got {self.aggregator!r}")

    def finish(self, merged: torch.Tensor) -> torch.Tensor:
        """What this reducer returns for a merged part: the merge itself (the lab's lying reducer
        overrides this, :class:`p2p_diloco.lab.faults.LyingMergeRule`)."""
        return merged


def capped_weights(claims: Sequence, rule: MergeRule) -> list[float]:
    """The weights of a group's members in its order from their gathered claims: invalid claims (not
    a finite number >= 0) count as 0 (the island rejects such a round anyway), then the cap."""
    weights = [float(w) if isinstance(w, (int, float)) and math.isfinite(w) and w >= 0 else 0.0 for w in claims]
    return robust.cap_weights(weights, rule.weight_cap, floor=MIN_WEIGHT)


class OutlierBook:
    """Per member of the round (in the group's order), parts this member reduced with it and parts in
    which it was an outlier: float32 [MAX_MEMBERS, 2] in shared memory, written by the averager
    process, read by the island after the round."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    @staticmethod
    def allocate() -> torch.Tensor:
        """A zeroed table in shared memory (float32 [MAX_MEMBERS, 2])."""
        return torch.zeros(MAX_MEMBERS, 2, dtype=torch.float32).share_memory_()

    def reset(self) -> None:
        """Forget the last round (before a new all-reduce)."""
        self.table.zero_()

    def note(self, member: int, outlier: bool) -> None:
        """One more part reduced with member ``member`` (group index), an outlier there or not."""
        if 0 <= member < MAX_MEMBERS:
            self.table[member, 0] += 1.0
            self.table[member, 1] += float(outlier)

    @staticmethod
    def read(table: torch.Tensor, peers: Sequence) -> dict:
        """peer -> (parts reduced with it, parts in which it was an outlier) for ``peers`` in the
        group's order, those this member reduced at least one part with."""
        rows = table[:len(peers)].tolist()
        return {peer: (int(seen), int(out)) for peer, (seen, out) in zip(peers, rows) if seen > 0}


class _Collector:
    """Stands in for hivemind's accumulator tensor of one part: ``add_`` keeps each sender's part and
    weight, ``div_`` (hivemind calls it once every sender is in) returns the merged part."""

    def __init__(self, reducer: "RobustPartReducer"):
        self.reducer, self.parts = reducer, []

    def add_(self, part: torch.Tensor, alpha: float = 1.0):
        self.parts.append((getattr(part, "_p2p_sender", -1), part, float(alpha)))
        return self

    def div_(self, _denominator: float) -> torch.Tensor:
        return self.reducer.merge_part(self.parts)


def merge_points(points: torch.Tensor, weights: torch.Tensor, rule: MergeRule) -> tuple[torch.Tensor, list]:
    """A reducer's merge of one part (docs/SECURITY.md, "Robust merging").

    Listeners (weight at most :data:`MIN_WEIGHT`: nothing to contribute) are left out of it. Among
    the contributors, CenteredClip gives each one's distance to the robust center over the median
    distance; with 3 or more, those above ``rule.outlier_ratio`` (far off: a reversed or noisy update at
    the bound) are left out too, and the rest are merged again. With ``mean`` the merge is the
    weighted mean of everyone (outliers are still measured, for detection).

    :param points: float32 [n, d], one row per sender
    :param weights: float64 [n], the senders' capped weights
    :returns: the merged part (float32 [d]; every element within the senders' range of it) and, per
        sender, its distance ratio (None for listeners, and when fewer than 3 contributed: nothing
        tells 2 apart)
    """
    floor = weights.clamp(min=MIN_WEIGHT)
    contributors = (weights > MIN_WEIGHT).nonzero().flatten()
    if rule.aggregator == "mean" or len(contributors) == 0:
        mean = ((floor / floor.sum()) @ points.to(torch.float64)).to(torch.float32)
    ratios: list = [None] * points.shape[0]
    if len(contributors) == 0:
        return mean, ratios
    first = robust.centered_clip(points[contributors], weights[contributors], radius_factor=rule.radius_factor)
    if len(contributors) < 3:
        return (mean if rule.aggregator == "mean" else first.center), ratios
    measured = first.outlier_ratios()
    for index, ratio in zip(contributors.tolist(), measured.tolist()):
        ratios[index] = ratio
    if rule.aggregator == "mean":
        return mean, ratios
    keep = contributors[measured <= rule.outlier_ratio]
    if len(keep) == len(contributors) or len(keep) == 0:
        return first.center, ratios
    return robust.centered_clip(points[keep], weights[keep], radius_factor=rule.radius_factor).center, ratios


def _runner_classes():
    from hivemind.averaging.allreduce import AllReduceRunner
    from hivemind.averaging.partition import TensorPartReducer

    class RobustPartReducer(TensorPartReducer):
        """hivemind's reducer with capped weights per sender (``weights``, by sender index) and a
        robust merge per part (:class:`MergeRule`); notes outliers in ``book`` by member index."""

        def __init__(self, part_shapes, num_senders: int, *, weights: Sequence[float], members: Sequence[int],
                     rule: MergeRule, book: Optional[OutlierBook]):
            self.weights, self.members, self.rule, self.book = list(weights), list(members), rule, book
            super().__init__(part_shapes, num_senders)

        def reset_accumulators(self):
            super().reset_accumulators()
            if not self.finished.is_set():
                self.accumulator = _Collector(self)

        async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                                  weight: float = 1.0) -> torch.Tensor:
            tensor_part._p2p_sender = sender_index  # which row of the part this is (see _Collector)
            # the capped gathered claim, never the weight the sender wrote into its message
            return await super().accumulate_part(sender_index, part_index, tensor_part,
                                                 weight=max(self.weights[sender_index], MIN_WEIGHT))

        def merge_part(self, parts: list) -> torch.Tensor:
            """One part's merge: :func:`merge_points` of the senders' parts, by sender index."""
            parts = sorted(parts, key=lambda entry: entry[0])  # the same answer whatever the arrival order
            points = torch.stack([part.reshape(-1).to(torch.float32) for _, part, _ in parts])
            weights = torch.tensor([w for _, _, w in parts], dtype=torch.float64)
            merged, ratios = merge_points(points, weights, self.rule)
            if self.book is not None:
                for (sender, _, _), ratio in zip(parts, ratios):
                    if ratio is not None and 0 <= sender < len(self.members):
                        self.book.note(self.members[sender], ratio > self.rule.outlier_ratio)
            return self.rule.finish(merged).view(parts[0][1].shape)

    class RobustAllReduceRunner(AllReduceRunner):
        """hivemind's ``AllReduceRunner``; given ``merge`` (the run's rule and the group's capped
        weights), its reducer is a :class:`RobustPartReducer`."""

        def __init__(self, *, merge: Optional[dict] = None, **kwargs):
            super().__init__(**kwargs)
            if merge is None:
                return
            members = [self.ordered_peer_ids.index(peer) for peer in self.sender_peer_ids]
            self.tensor_part_reducer.finished.set()  # hivemind's own, unused: finished quietly
            self.tensor_part_reducer = RobustPartReducer(
                tuple(part.shape for part in self.parts_for_local_averaging), len(self.sender_peer_ids),
                weights=[merge["weights"][i] for i in members], members=members, rule=merge["rule"],
                book=merge.get("book"))

    return RobustAllReduceRunner, RobustPartReducer


def install_runner() -> None:
    """In an averager process only: hivemind's averager builds :class:`RobustAllReduceRunner` (which,
    without ``merge``, is hivemind's own runner)."""
    import hivemind.averaging.averager as averager_module

    averager_module.AllReduceRunner = _runner_classes()[0]


def reducer_class():
    """:class:`RobustPartReducer` (for tests that drive it as hivemind's runner does)."""
    return _runner_classes()[1]
