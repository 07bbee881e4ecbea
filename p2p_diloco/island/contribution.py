"""A round's wire format and what each member checks in what comes back (docs/DESIGN.md, "One
round" and "What is validated where").

What a member sends for one fragment: its clipped pseudo-gradient Delta (or, for RDA tensors, the
unit direction Delta/||Delta||, its norm going into the gathered metadata), written into the
channel's buffers either as ``C + Delta`` (plain fp32, exact averages) or as raw values that the
averager puts on the round's shared low-bit grid. What it checks: every member's gathered metadata
(types, finite weights, reported bounds, grid exponents, RDA norms) and the averaged result (finite,
within the bounds an honest group can produce, on the grid), and where no reducer averaged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from p2p_diloco.algo import grid, outer, robust, wire
from p2p_diloco.config import OuterConfig
from p2p_diloco.net.reducer import MIN_WEIGHT, MergeRule

WEIGHT_UNIT = 1e6  # token weights are sent in units of 10^6 (tokens^2 / step) to stay well inside fp32
LISTENER_WEIGHT = MIN_WEIGHT  # weight of a member with nothing to contribute: it only receives the result
MAX_VERSION = 2**48  # no honest fragment version comes near it (a round a millisecond for 8,000 years)
MIN_OTHERS_SHARE = 1e-3  # below this share of the others' weight, a round's result is not checked for failed parts


@dataclass
class Contribution:
    """What this member averages in one round (fp32 CPU tensors in fragment order).

    :param delta: its pseudo-gradient Theta_p - theta_p, clipped to +-max_delta
    :param values: what goes on the wire per tensor: Delta, or the unit direction for RDA tensors
    :param norms: per tensor, ||Delta|| for RDA tensors (0.0 elsewhere)
    :param weight: its merge weight, tokens^2 / steps in units of :data:`WEIGHT_UNIT`
    :param clipped: elements clipped to +-max_delta
    :param tokens: the tokens it claims in the gathered metadata (those trained since its snapshot)
    :param steps: the inner steps it claims
    """

    delta: list[torch.Tensor]
    values: list[torch.Tensor]
    norms: list[float]
    weight: float
    clipped: int
    tokens: int = 0
    steps: int = 0


class RoundFormat:
    """The wire format and checks of one fragment's rounds (every member of a run computes the same).

    :param config: the run's outer settings (max_delta, merge, codec)
    :param names: the fragment's parameter names (RDA keeps embeddings on the plain mean)
    :param shapes: the fragment's parameter shapes, same order
    """

    def __init__(self, config: OuterConfig, names: Sequence[str], shapes: Sequence[torch.Size]):
        self.shapes = list(shapes)
        self.max_delta = config.max_delta
        self.levels = grid.levels_of(config.codec)  # 0: plain fp32 rounds
        # RDA merges unit directions per tensor; embeddings stay on the plain mean (arXiv 2604.21428)
        self.rda = [config.merge == "rda" and "embed" not in name for name in names]
        offset, unit_offset = wire.wire_offset(config.max_delta), wire.wire_offset(1.0)
        self.offsets = [unit_offset if rda else offset for rda in self.rda]
        self.bounds = [wire.wire_bound(1.0, unit_offset) if rda else wire.wire_bound(config.max_delta, offset)
                       for rda in self.rda]
        if self.levels:  # grid values carry at most half a step of rounding on top
            self.bounds = [2.0 * b for b in self.bounds]
        # the largest grid exponent and RDA norm an honest member can have (values clipped to max_delta)
        self.ceilings = [grid.ceiling_exponent(1.0 if rda else config.max_delta, self.levels) if self.levels else 0
                         for rda in self.rda]
        self.norm_limits = [config.max_delta * math.sqrt(s.numel()) * (1 + 1e-6) + 1e-30 for s in self.shapes]
        self.fragment_norm_limit = config.max_delta * math.sqrt(sum(s.numel() for s in self.shapes)) * (1 + 1e-6)
        self.chunks = grid.num_chunks(self.shapes)
        self.weight_cap, self.norm_ratio = config.weight_cap, config.norm_ratio
        # how every member's reducer merges its parts (the run's, like the rest of this format)
        self.merge_rule = MergeRule(aggregator=config.aggregator, weight_cap=config.weight_cap,
                                    radius_factor=config.clip_radius, outlier_ratio=config.outlier_ratio)

    @property
    def report_bound(self) -> float:
        """The largest |value| an honest member reports having sent (``delta_max``)."""
        return max(self.bounds)

    # ------------------------------------------------------------------ what we send

    def contribution(self, delta: list[torch.Tensor], tokens: int, steps: int) -> Contribution:
        """Clip ``delta`` in place and turn it into what goes on the wire, with its weight
        ("quantity x quality", tokens^2 / steps: Decoupled DiLoCo, arXiv 2604.21428)."""
        clipped = wire.clip_(delta, self.max_delta)
        values, norms = outer.wire_values(delta, self.rda)
        return Contribution(delta, values, norms, outer.token_weight(tokens, steps) / WEIGHT_UNIT, clipped, tokens, steps)

    def write(self, contribution: Contribution, buffers: Sequence[torch.Tensor]) -> dict:
        """Put the contribution into the channel's buffers; returns what the gathered metadata
        reports of it: ``delta_max`` (the largest |value| sent), ``delta_norm`` (||Delta||_2 of the
        whole fragment, for the norm bound), ``norms`` and, with a low-bit codec, ``exponents`` (the
        grid each chunk needs)."""
        self.encode(contribution.values, buffers)
        report = {"delta_max": wire.max_abs_sent(buffers, 0.0 if self.levels else self.offsets),
                  "delta_norm": fragment_norm(contribution.delta), "norms": contribution.norms}
        if self.levels:
            report["exponents"] = grid.exponents_report(buffers, self.levels)
        return report

    def encode(self, values: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
        """Write the wire values: raw (the averager puts them on the round's grid) with a low-bit
        codec, else C + value (exact averages, :func:`p2p_diloco.algo.wire.encode_for_wire`)."""
        if self.levels:
            for value, buffer in zip(values, buffers):
                buffer.copy_(value)
        else:
            wire.encode_for_wire(values, buffers, self.offsets)

    # ------------------------------------------------------------------ what comes back

    def read(self, buffers: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
             used_grid: Optional[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """The round's merged wire values (mean Delta, or mean unit direction for RDA tensors), the
        values this member actually sent, both in value space, and the grid per tensor (empty for
        plain fp32); with a low-bit codec, on the grid the averager used (``used_grid``, its word)."""
        received = [t.clone() for t in buffers]
        if not self.levels:
            return wire.decode_from_wire(received, self.offsets), wire.wire_roundtrip(values, self.offsets), []
        exponents = grid.split_grid(used_grid, self.shapes)
        sent = [grid.quantize(v, e, self.levels) for v, e in zip(values, exponents)]
        return [grid.from_wire(r, e) for r, e in zip(received, exponents)], sent, exponents

    @staticmethod
    def members(gathered: Optional[dict]) -> list[dict]:
        """The members whose gathered metadata is well-formed (others are not members)."""
        return [m for m in (gathered or {}).values() if _valid_member(m)]

    def misreporting(self, members: Sequence[dict], island: str) -> list[str]:
        """Other members whose gathered metadata no honest member would send: a largest sent value
        out of bounds (NaN, Inf, huge), an update norm that no clipped pseudo-gradient can have (or
        shorter than its other reports), a weight that is not tokens^2 / steps of its own claims, a
        version no run reaches, grid exponents beyond what that value needs, or RDA norms that no
        clipped pseudo-gradient can have."""
        culprits = []
        for m in members:
            honest = (reported_within(m.get("delta_max"), self.report_bound) and consistent_weight(m)
                      and self._plausible_norm(m) and 0 <= m["version"] <= MAX_VERSION)
            if honest and self.levels:
                report = m.get("exponents")
                needed = grid.ceiling_exponent(max(float(m["delta_max"]), 0.0), self.levels)
                honest = (isinstance(report, (bytes, bytearray)) and len(report) == 2 * self.chunks
                          and int(np.frombuffer(report, dtype="<i2").max(initial=grid.EMPTY_EXPONENT)) <= needed)
            if honest and any(self.rda):
                norms = m.get("norms")
                honest = isinstance(norms, list) and len(norms) == len(self.rda) and all(
                    isinstance(n, (int, float)) and 0.0 <= n <= limit for n, limit in zip(norms, self.norm_limits))
            if not honest:
                culprits.append(m["island"])
        return sorted(c for c in culprits if c != island)

    def _plausible_norm(self, member: dict) -> bool:
        """The member's ``delta_norm`` is one a clipped update can have and no shorter than what it
        reports elsewhere (under-reporting would shorten bounded rounds): its largest sent value (a norm
        is never below an element; fp32's wire rounding aside) or, with RDA tensors (whose wire
        values are unit directions), the norm of its per-tensor RDA norms."""
        norm = member.get("delta_norm")
        if not reported_within(norm, self.fragment_norm_limit) or norm < 0:
            return False
        if any(self.rda):
            norms = member.get("norms")
            if not isinstance(norms, list) or not all(reported_within(n, math.inf) for n in norms):
                return False
            floor = math.hypot(*(float(n) for n in norms))
        else:
            floor = float(member["delta_max"])
        return norm >= floor * (1 - 1e-3) - 1e-6 * self.max_delta

    def out_of_bounds(self, members: Sequence[dict], island: str) -> list[str]:
        """Other members whose own report of what they sent is out of bounds."""
        return sorted(m["island"] for m in members
                      if m["island"] != island and not reported_within(m.get("delta_max"), self.report_bound))

    def valid_result(self, merged: Sequence[torch.Tensor], exponents: Sequence[torch.Tensor]) -> bool:
        """The averaged values are what honest members can produce: finite, within the bounds, and on
        a low-bit grid within its range (else some member sent garbage or values off the grid)."""
        if not wire.within_bound(merged, self.bounds):
            return False
        if self.levels:
            return all(grid.within_grid(t, e, self.levels) for t, e in zip(merged, exponents))
        return True

    def bounded(self, members: Sequence[dict]) -> Optional[list[dict]]:
        """The contributors (members that weigh more than a listener) of a round the norm bound
        applies to: 2 or more (docs/SECURITY.md, "The norm bound"); None for other rounds, with the
        plain ``mean`` aggregator or a norm ratio of 0."""
        if self.merge_rule.aggregator == "mean" or self.norm_ratio == 0:
            return None
        contributors = [m for m in members if m["weight"] > LISTENER_WEIGHT]
        return contributors if len(contributors) >= 2 else None

    def pair_partner(self, members: Sequence[dict], island: str) -> Optional[str]:
        """The other contributor of a :meth:`bounded` round of exactly 2 contributors, one of them
        ``island``; None for any other round (more contributors, a name twice, ``island`` not in it)."""
        contributors = [m["island"] for m in self.bounded(members) or []]
        if len(contributors) != 2 or island not in contributors or len(set(contributors)) != 2:
            return None
        return contributors[1] if contributors[0] == island else contributors[0]

    def halvings(self, merged: Sequence[torch.Tensor], members: Sequence[dict]) -> Optional[int]:
        """How many times to halve the merged pseudo-gradient of a :meth:`bounded` round:
        :func:`p2p_diloco.algo.robust.norm_halvings` with ``outer.norm_ratio``; 0 for other rounds;
        None: apply nothing. Call it on members that passed :meth:`misreporting`."""
        contributors = self.bounded(members)
        if contributors is None:
            return 0
        return robust.norm_halvings(fragment_norm(merged), [float(m["delta_norm"]) for m in contributors],
                                    self.norm_ratio)

    def unaveraged(self, merged: Sequence[torch.Tensor], sent: Sequence[torch.Tensor], members: Sequence[dict],
                   weight: float, failed: int, failed_mask: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """Boolean masks (shaped like the tensors) of where hivemind dropped a member that stopped
        answering mid-round: the parts it was to reduce kept each member's own values. None when
        there are none.

        The averager records those elements exactly (``failed >= 0`` elements, ``failed_mask``); only
        if it could not (``failed == -1``) are they guessed from the result
        (:func:`p2p_diloco.algo.wire.find_unaveraged`), and not when the others weigh next to
        nothing (listeners): nothing to tell apart then."""
        if failed == 0:
            return None
        if failed > 0:
            mask = failed_mask.to(torch.bool)
            return [part.view(t.shape).clone() for part, t in zip(torch.split(mask, [t.numel() for t in merged]), merged)]
        total = sum(max(m["weight"], LISTENER_WEIGHT) for m in members)
        if total <= 0 or 1.0 - max(weight, LISTENER_WEIGHT) / total < MIN_OTHERS_SHARE:
            return None
        size = sum(t.numel() for t in merged)
        return wire.find_unaveraged(merged, sent, min_run=min(1024, max(2, size // 64)))

    @staticmethod
    def reduced_by(merged: Sequence[torch.Tensor], reducer_of: torch.Tensor, reducers: Sequence[int],
                   masks: Optional[Sequence[torch.Tensor]] = None) -> list[torch.Tensor]:
        """Boolean masks (shaped like ``merged``) of the elements that the members at group indices
        ``reducers`` reduced (``reducer_of``: int16 [numel], fragment order), or-ed into ``masks``
        (:meth:`unaveraged`'s) when given."""
        wanted = torch.isin(reducer_of.to(torch.int64), torch.tensor(sorted(reducers), dtype=torch.int64))
        parts = [part.view(t.shape).clone() for part, t in zip(torch.split(wanted, [t.numel() for t in merged]), merged)]
        return parts if masks is None else [a | b for a, b in zip(masks, parts)]

    def drop_unaveraged(self, merged: list[torch.Tensor], sent: list[torch.Tensor],
                        masks: Sequence[torch.Tensor]) -> float:
        """Give the parts no reducer averaged a zero merged pseudo-gradient (+0.0: the same bits on
        every member that saw the same failure) and count them as not sent (the island keeps its
        progress there); an RDA tensor with a hole has no norm to rescale to and is dropped whole.
        Returns the share of the fragment dropped."""
        for tensor, value, mask, use_rda in zip(merged, sent, masks, self.rda):
            if use_rda and bool(mask.any()):
                mask.fill_(True)
            tensor.masked_fill_(mask, 0.0)
            value.masked_fill_(mask, 0.0)
        return sum(int(mask.sum()) for mask in masks) / max(1, sum(t.numel() for t in merged))

    def merge(self, averaged: Sequence[torch.Tensor], members: Sequence[dict]) -> list[torch.Tensor]:
        """The merged pseudo-gradient: the weighted mean as it is, RDA tensors rescaled to the mean of
        the members' gathered norms (:func:`p2p_diloco.algo.outer.merge_result`)."""
        return outer.merge_result(averaged, self.rda, member_norms(members, len(averaged)), self.weights(members))

    def weights(self, members: Sequence[dict]) -> list[float]:
        """The members' merge weights as the reducers used them: their claims capped at
        ``weight_cap`` x the lower median (:func:`p2p_diloco.algo.robust.cap_weights`), listeners at
        :data:`LISTENER_WEIGHT`."""
        capped = robust.cap_weights([m["weight"] for m in members], self.weight_cap, floor=LISTENER_WEIGHT)
        return [max(w, LISTENER_WEIGHT) for w in capped]

    def carry_base(self, local: Sequence[torch.Tensor], contribution: Contribution,
                   sent: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What the learner's progress is measured from once the round lands: its snapshot plus what
        it could not send (quantization error, parts no reducer averaged; everything for a listener),
        which so goes into its next round (error feedback through the carry base). An RDA tensor
        lands as our norm along our (rounded) direction."""
        if contribution.weight <= 0.0:
            sent = [torch.zeros_like(d) for d in contribution.delta]
        else:
            sent = [outer.rescale(s, n) if rda else s for s, n, rda in zip(sent, contribution.norms, self.rda)]
        return [x + (d - s) for x, d, s in zip(local, contribution.delta, sent)]


def fragment_norm(tensors: Sequence[torch.Tensor]) -> float:
    """||tensors||_2 over all of them (float64 sums of squares)."""
    return math.sqrt(sum(float(t.detach().to(torch.float64).square().sum()) for t in tensors))


def reported_within(value, bound: float) -> bool:
    """``value`` is a finite number with |value| <= bound."""
    return isinstance(value, (int, float)) and math.isfinite(value) and abs(value) <= bound


def consistent_weight(member: dict) -> bool:
    """The member's weight is tokens^2 / steps of the tokens and steps it claims (fp32-close)."""
    tokens, steps = member.get("tokens"), member.get("steps")
    if not isinstance(tokens, int) or not isinstance(steps, int) or tokens < 0 or steps < 0:
        return False
    want = outer.token_weight(tokens, steps) / WEIGHT_UNIT
    return abs(float(member["weight"]) - want) <= 1e-6 * max(1.0, want)


def member_norms(members: Sequence[dict], count: int) -> list[list[float]]:
    """Each member's per-tensor norms from its gathered metadata (zeros where malformed)."""
    norms = []
    for member in members:
        values = member.get("norms")
        ok = isinstance(values, list) and len(values) == count and all(
            isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values)
        norms.append([float(v) for v in values] if ok else [0.0] * count)
    return norms


def _valid_member(member) -> bool:
    return (
        isinstance(member, dict)
        and isinstance(member.get("version"), int)
        and isinstance(member.get("hash"), str)
        and isinstance(member.get("weight"), (int, float))
        and math.isfinite(member["weight"])
        and member["weight"] >= 0
        and isinstance(member.get("island"), str)
    )
