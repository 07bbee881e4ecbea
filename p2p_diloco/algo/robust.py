"""Bounded trust in one round's contributions (docs/DESIGN.md, "Faulty and malicious members";
docs/SECURITY.md): weight caps, so that no member's claimed weight decides the average, and
CenteredClip, the robust mean a reducer takes of its part of the members' pseudo-gradients. Pure
maths on tensors; the averager's reducer (:mod:`p2p_diloco.net.reducer`) and the island's checks
call it.

Sources: CenteredClip, Karimireddy, He and Jaggi, "Learning from History for Byzantine Robust
Optimization", arXiv 2012.10333, Alg. 2 (eq. 3); applied per part of an all-reduce as ButterflyClip in
Gorbunov et al., "Secure Distributed Training at Scale" (BTARD), arXiv 2106.11257, Sec. 3.1.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

AGGREGATORS = ("mean", "centered_clip")
NORM_RATIO = 2.0  # a round's merged update is at most this x its contributors' lower median update norm


def cap_weights(weights: Sequence[float], ratio: float, floor: float = 0.0) -> list[float]:
    """Each member's weight capped at ``ratio`` times the lower median weight of the members that
    weigh more than ``floor`` (listeners, which contribute nothing, do not drag the median down).

    A member that claims an enormous weight (a huge token count) so weighs at most ``ratio`` x the
    lower median: among K contributing members whose K - 1 others are honest and weigh alike, the
    lower median is an honest weight and its share of the round is at most r / (r + K - 1): for the
    default r = 1.5 (``outer.weight_cap``), 0.6 of a pair, 0.43 of a group of 3, 0.33 of 4, 0.18 of
    8. (The lower median, not the mean of the two middle claims: of a pair, that mean is half the
    attacker's own claim.) Honest islands keep their tokens^2/steps ordering up to the cap: an island
    1.5x the median's speed weighs 1.5x, a faster one no more (the price of the bound). Every member
    computes the same caps from the same gathered metadata.

    :param weights: per member, its claimed weight (finite, >= 0)
    :param ratio: the cap as a multiple of the lower median (> 0)
    :param floor: weights at or below it are not counted in the median
    :returns: the capped weights, same order
    :raises ValueError: ratio not positive
    """
    if not ratio > 0:
        raise ValueError(f"ratio must be positive, got {ratio}")
    counted = [float(w) for w in weights if w > floor]
    if not counted:
        return [float(w) for w in weights]
    cap = ratio * statistics.median_low(counted)
    return [min(float(w), cap) for w in weights]


def norm_halvings(merged_norm: float, norms: Sequence[float], ratio: float = NORM_RATIO) -> Optional[int]:
    """How many times the merged update of a round of 2 or more contributors is halved so that its
    norm is at most ``ratio`` x the lower median of the contributors' reported update norms (of a
    pair, the shorter one) (docs/SECURITY.md, "The norm bound"); 0 when it already is.

    Where attackers are no more than half of a group's contributors, no median tells them apart
    (of a pair, nothing tells which one is honest), but the lower median of the norms is no longer
    than an honest one: such a round moves the model by at most ``ratio`` x an honest update,
    whatever the attackers agree on. A member that under-reports its norm only shortens the result, and
    over-reporting cannot lift the lower median above an honest norm. A merge of honest updates is
    no longer than the longest of them (shorter, as their directions differ), so honest rounds are
    rarely touched; islands whose updates are far apart in length (3-4x more inner steps) get
    theirs shortened, not refused. Halving (multiplying by a power of two) is exact in floating point
    (correctly rounded for subnormal results), so every member that holds the same result and
    metadata ends with the same bits.

    :param merged_norm: ||merged pseudo-gradient||_2 of the fragment
    :param norms: the contributors' reported ||Delta||_2 (finite, >= 0), 2 or more
    :param ratio: the bound over the lower median norm (> 0)
    :returns: k >= 0 such that merged_norm * 2^-k <= ratio * median_low(norms) (the smallest such k),
        or None when no reasonable k does (a result that is not finite, or a median norm of 0 or so
        small that k would exceed 1000): apply nothing
    :raises ValueError: fewer than 2 norms, or ratio not positive
    """
    if len(norms) < 2:
        raise ValueError(f"the bound needs 2 or more contributors' norms, got {len(norms)}")
    if not ratio > 0:
        raise ValueError(f"ratio must be positive, got {ratio}")
    bound = ratio * statistics.median_low([float(n) for n in norms])
    if not math.isfinite(merged_norm):
        return None
    if merged_norm <= bound:
        return 0
    excess = merged_norm / bound if bound > 0 else math.inf
    if not excess < 2.0**1000:  # a median norm of 0 or next to it (nothing learned yet, or a lie)
        return None
    k = max(1, math.ceil(math.log2(excess)))
    while merged_norm * 2.0 ** -k > bound:  # (log2's rounding)
        k += 1
    return k


@dataclass
class ClipResult:
    """One part's CenteredClip.

    :param center: the robust mean, fp32, shape [d]
    :param distances: per member, ||x_i - center||_2 (float64, shape [n])
    :param radius: the clipping radius tau used (0.0 when every member sent the same values)
    :param iterations: fixed-point iterations run
    """

    center: torch.Tensor
    distances: torch.Tensor
    radius: float
    iterations: int

    def outlier_ratios(self) -> torch.Tensor:
        """Per member, its distance over the median distance (float64 [n]; 1.0 for all when the
        median is 0 and so is theirs, inf for one that alone differs)."""
        median = float(_median(self.distances))
        if median > 0:
            return self.distances / median
        return torch.where(self.distances > 0, torch.full_like(self.distances, math.inf),
                           torch.ones_like(self.distances))


def centered_clip(points: torch.Tensor, weights: torch.Tensor, *, radius_factor: float = 2.0,
                  iterations: int = 10, tolerance: float = 1e-6) -> ClipResult:
    """The weighted CenteredClip of ``points``: the fixed point v of
    v <- v + sum_i w_i clip_tau(x_i - v) / sum_i w_i, with clip_tau(z) = z * min(1, tau / ||z||)
    (arXiv 2012.10333, eq. 3), started at the coordinate-wise median, with tau = ``radius_factor``
    x the median of the members' distances to that median (scale-free: no tau to tune per model).

    Honest members, whose distances are alike, are rarely clipped, so an honest round is close to
    the plain weighted mean; one member far from the others moves the result by at most its share
    times tau. The start is within the members' per-element range, and each step is a convex
    combination of v and the points, so every element of the result lies between the members'
    smallest and largest values of it: the exact-average wire encoding and the low-bit grid's
    bounds still hold for it. With 2 members or all members equal
    it is the weighted mean (there is no majority to trust).

    :param points: float32 [n, d], one row per member (n >= 1)
    :param weights: [n], >= 0 with a positive sum (capped: :func:`cap_weights`)
    :param radius_factor: tau over the median distance (> 0)
    :param iterations: at most this many fixed-point steps
    :param tolerance: stop once a step moves v by less than ``tolerance`` x tau
    :returns: the center (fp32 [d]), the distances and the radius
    :raises ValueError: shapes that disagree, no positive weight, radius_factor not positive
    """
    if points.dim() != 2 or weights.shape != (points.shape[0],) or points.shape[0] < 1:
        raise ValueError(f"points must be [n, d] and weights [n], got {tuple(points.shape)} and {tuple(weights.shape)}")
    if not radius_factor > 0:
        raise ValueError(f"radius_factor must be positive, got {radius_factor}")
    x = points.detach().to(torch.float64)
    w = weights.detach().to(torch.float64).clamp(min=0.0)
    total = float(w.sum())
    if not total > 0 or not math.isfinite(total):
        raise ValueError("weights must have a positive, finite sum")
    w = w / total
    if x.shape[0] <= 2:  # no majority: the weighted mean
        center = (w[:, None] * x).sum(0)
        return ClipResult(center.to(torch.float32), torch.linalg.vector_norm(x - center, dim=1), 0.0, 0)
    v = _median(x)
    tau = radius_factor * float(_median(torch.linalg.vector_norm(x - v, dim=1)))
    steps = 0
    if tau > 0:
        for steps in range(1, iterations + 1):
            diff = x - v
            norms = torch.linalg.vector_norm(diff, dim=1)
            scale = torch.clamp(tau / torch.clamp(norms, min=1e-300), max=1.0)
            move = ((w * scale)[:, None] * diff).sum(0)
            v = v + move
            if float(torch.linalg.vector_norm(move)) <= tolerance * tau:
                break
    # (tau == 0: more than half the members sent the same values, and the median is those values)
    return ClipResult(v.to(torch.float32), torch.linalg.vector_norm(x - v, dim=1), tau, steps)


def _median(x: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median over dim 0 (the mean of the two middle values for an even count)."""
    ordered = torch.sort(x, dim=0).values
    n = ordered.shape[0]
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def reducer_agreement(merged: Sequence[torch.Tensor], sent: Sequence[torch.Tensor],
                      reducer_of: torch.Tensor, min_share: float = 0.1) -> dict[int, float]:
    """Per reducer, the cosine between the merged values it returned and the values this member sent
    for the elements it reduced (docs/SECURITY.md, "Lying reducers").

    Every reducer merges a slice of the same members' updates, so an honest reducer's slice of the
    result agrees with our slice about as much as every other reducer's does (our own update is one
    of the members it merged); a reducer that returns the average reversed, or anything unrelated to
    what the members sent, agrees far less. A reducer of a slice where we sent next to nothing
    (RMS below ``min_share`` x the median reducer's: rows of the embedding we never trained) is left
    out: our agreement there says nothing. :func:`against_momentum` takes the same cosine with the
    outer momentum in place of ``sent``.

    :param merged: the round's merged values per tensor (value space), fp32
    :param sent: what this member sent per tensor (value space), same shapes
    :param reducer_of: int16 [numel] in fragment order: which member (group index) reduced each
        element, -1 where unknown
    :param min_share: see above
    :returns: group index -> cosine
    """
    total = sum(t.numel() for t in merged)
    if reducer_of.numel() != total:
        return {}
    size = int(reducer_of.max()) + 2 if total else 1  # bins: -1 -> 0, index i -> i + 1
    dots, merged_sq, sent_sq, counts = (torch.zeros(size, dtype=torch.float64) for _ in range(4))
    offset = 0
    for a, b in zip(merged, sent):  # tensor by tensor: no fragment-sized float64 copies
        index = reducer_of[offset:offset + a.numel()].to(torch.int64) + 1
        a, b = a.reshape(-1).to(torch.float64), b.reshape(-1).to(torch.float64)
        dots += torch.bincount(index, weights=a * b, minlength=size)
        merged_sq += torch.bincount(index, weights=a * a, minlength=size)
        sent_sq += torch.bincount(index, weights=b * b, minlength=size)
        counts += torch.bincount(index, minlength=size).to(torch.float64)
        offset += a.numel()
    present = [i for i in range(1, size) if counts[i] > 0]
    rms = {i: math.sqrt(float(sent_sq[i] / counts[i])) for i in present}
    floor = min_share * statistics.median(rms.values()) if rms else 0.0
    result = {}
    for i in present:
        norms = math.sqrt(float(merged_sq[i]) * float(sent_sq[i]))
        if rms[i] > floor and norms > 0 and math.isfinite(norms):
            result[i - 1] = float(dots[i]) / norms
    return result


def against_momentum(agreement: dict[int, float], *, floor: float = 0.1, fraction: float = 0.5) -> list[int]:
    """The reducers whose share of a round's result points against the outer momentum while the
    other reducers' shares point along it (docs/SECURITY.md, "Lying reducers").

    Unlike :func:`disagreeing`, which takes one member's own update, this takes the outer momentum
    m_p of the round's base (:func:`reducer_agreement` of the merged values with m_p): every member
    on that base holds the same m_p and receives the same merged values from an honest reducer, so
    every such member names the same reducers and can leave their shares out of the round with the
    same bits (hivemind reorders the group every round, so a reducer's share lies where the others
    reduced before). A reducer that returns the average reversed points against m_p as much as the
    others point along it; an honest one against it as far is rare, and costs only that round's step
    on its share (its progress goes into the next round).

    :param agreement: group index -> cosine of the merged values with m_p, per reducer
    :param floor: the median must be at least this, else m_p says nothing (a fresh state: m_p = 0)
    :param fraction: a reducer below ``-fraction`` x the median points against it
    :returns: the group indices, sorted; none when fewer than 3 reducers are compared
    """
    return _below_median(agreement, floor, -fraction)


def disagreeing(agreement: dict[int, float], *, floor: float = 0.2, fraction: float = 0.25) -> list[int]:
    """The reducers whose agreement is far below the others'.

    :param agreement: group index -> cosine (:func:`reducer_agreement`)
    :param floor: the median agreement must be at least this, else the round gives no signal
        (updates that do not correlate)
    :param fraction: a reducer below ``fraction`` x the median agreement disagrees
    :returns: the group indices that disagree, sorted; none when fewer than 3 reducers are compared
    """
    return _below_median(agreement, floor, fraction)


def _below_median(agreement: dict[int, float], floor: float, factor: float) -> list[int]:
    """The indices whose value is below ``factor`` x the median of 3 or more values, sorted; none
    when fewer are given or the median is below ``floor``."""
    if len(agreement) < 3:
        return []
    median = statistics.median(agreement.values())
    if median < floor:
        return []
    return sorted(index for index, value in agreement.items() if value < factor * median)
