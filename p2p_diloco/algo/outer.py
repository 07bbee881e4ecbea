"""The outer-loop maths, with no networking: pseudo-gradients, weights, merges (mean, RDA), the
outer optimizer, how a round's result lands on the island, and the identity of global parameters
(hashes, the canonical base). What goes on the wire is in :mod:`p2p_diloco.algo.wire`.

All tensors here are fp32 CPU tensors given as sequences in fragment order.

Determinism: members of a round must end with bitwise identical global parameters, including on
different CPUs. Every update below is therefore written as separate multiplies and adds (each
rounded once, as IEEE 754 prescribes), never as ``add(..., alpha=x)`` or ``addcmul``, which some
kernels fuse into one FMA on some processors and not on others.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterable, Optional, Sequence

import torch

Tensors = Sequence[torch.Tensor]


def pseudo_gradient(global_params: Tensors, local_params: Tensors) -> list[torch.Tensor]:
    """Delta = Theta - theta: the outer gradient of one island (arXiv 2311.08105, Alg. 1, line 12).

    Positive where local training moved a parameter down, so ``Theta - lr * Delta`` moves Theta the
    way the island moved. Shapes and dtypes follow the inputs (fp32).
    """
    return [theta_global - theta_local for theta_global, theta_local in zip(global_params, local_params, strict=True)]


def token_weight(tokens: int, steps: int) -> float:
    """Merge weight of one contribution: tokens^2 / steps, "quantity x quality"
    (Decoupled DiLoCo, arXiv 2604.21428, token-weighted merging).

    An island that trained more tokens, or larger batches per step, weighs more; no steps weighs 0.

    :param tokens: tokens trained since this fragment's last contribution
    :param steps: inner steps taken in that time
    """
    if steps <= 0 or tokens <= 0:
        return 0.0
    return float(tokens) * float(tokens) / float(steps)


def weighted_mean(deltas: Sequence[Tensors], weights: Sequence[float]) -> list[torch.Tensor]:
    """Reference weighted mean sum(w_i * Delta_i) / sum(w_i) of several islands' pseudo-gradients.

    What a round's all-reduce computes (hivemind's weighted average), as a reference for tests.
    Raises ValueError when the weights sum to zero.
    """
    total = float(sum(weights))
    if total <= 0.0:
        raise ValueError("weights sum to zero: nothing to average")
    merged = []
    for parts in zip(*deltas, strict=True):
        acc = torch.zeros_like(parts[0])
        for part, weight in zip(parts, weights, strict=True):
            acc += part * weight
        merged.append(acc / total)
    return merged


def _exact_norm(tensor: torch.Tensor) -> float:
    """||tensor||_2 computed the same way on every CPU (an exactly rounded sum of squares in float64),
    so members that hold the same bits get the same norm. A reference: it walks every element in
    Python (about 0.1 s per million elements)."""
    return math.sqrt(math.fsum((tensor.detach().to(torch.float64).reshape(-1) ** 2).tolist()))


def unit_directions(delta: Tensors) -> tuple[list[torch.Tensor], list[float]]:
    """Per tensor, Delta / ||Delta|| (zeros where ||Delta|| = 0) and ||Delta||: what an island puts on
    the wire and in the round's gathered metadata for radial-directional averaging (RDA).

    Directions are fp32 with |elements| <= 1 (shapes as ``delta``); norms are Python floats, summed
    in float64 (a member's own norm travels in the metadata, so other machines need not recompute it).
    """
    units, norms = [], []
    for tensor in delta:
        norm = float(torch.linalg.vector_norm(tensor.detach().to(torch.float64)))
        units.append(tensor / norm if norm > 0.0 else torch.zeros_like(tensor))
        norms.append(norm)
    return units, norms


def rda_combine(mean_units: Tensors, mean_norms: Sequence[float], eps: float = 1e-6) -> list[torch.Tensor]:
    """Recombine averaged directions and norms: per tensor, nbar * ubar / ||ubar||, so that the merged
    pseudo-gradient points along the weighted mean direction and has the weighted mean norm
    (radial-directional averaging; Decoupled DiLoCo, arXiv 2604.21428, merging).

    Where the directions cancel (||ubar|| < ``eps``: opposite updates, or all zero) there is no
    direction to rescale, and the tensor falls back to nbar * ubar, which *is* the weighted mean of
    the pseudo-gradients when the members' norms are equal (the usual cancelling case: equal and
    opposite updates give zero) and zero when all are zero; never a division by a vanishing norm.
    (The exact mean for unequal norms would need the raw pseudo-gradients on the wire as well,
    twice the bytes.)

    :param mean_units: weighted mean of the members' unit directions, per tensor (fp32)
    :param mean_norms: weighted mean of the members' norms, per tensor
    """
    merged = []
    for ubar, nbar in zip(mean_units, mean_norms, strict=True):
        length = _exact_norm(ubar)
        merged.append(ubar * (nbar / length) if length >= eps else ubar * nbar)
    return merged


def rda_mean(deltas: Sequence[Tensors], weights: Sequence[float], eps: float = 1e-6) -> list[torch.Tensor]:
    """Reference radial-directional average of several islands' pseudo-gradients, per tensor:
    the weighted mean of unit directions rescaled to the weighted mean of norms
    (Decoupled DiLoCo, arXiv 2604.21428), what a round with ``merge = "rda"`` computes with one
    all-reduce of the directions. One contributor gets its own Delta back; cancelling or all-zero
    directions fall back as :func:`rda_combine` says; zero total weight gives zeros (no update),
    never a division by zero.

    :param deltas: per island, its pseudo-gradient tensors (fp32, same shapes for every island)
    :param weights: per island, its merge weight (>= 0)
    """
    total = float(sum(weights))
    if total <= 0.0:
        return [torch.zeros_like(t) for t in deltas[0]]
    per_island = [unit_directions(delta) for delta in deltas]
    mean_units = weighted_mean([units for units, _ in per_island], weights)
    return rda_combine(mean_units, mean_norms([norms for _, norms in per_island], weights), eps)


def mean_norms(norms: Sequence[Sequence[float]], weights: Sequence[float]) -> list[float]:
    """Per tensor, the weighted mean of the members' norms, exactly rounded (math.fsum), so that every
    member computes the same value from the same gathered metadata; 0 for zero total weight."""
    total = math.fsum(weights)
    if total <= 0.0 or not norms:
        return [0.0] * (len(norms[0]) if norms else 0)
    return [math.fsum(w * n[j] for n, w in zip(norms, weights, strict=True)) / total for j in range(len(norms[0]))]


def wire_values(delta: Tensors, rda: Sequence[bool]) -> tuple[list[torch.Tensor], list[float]]:
    """What a member averages for each tensor: its unit direction where ``rda[j]`` (norm alongside,
    for the gathered metadata), else its pseudo-gradient (norm 0, unused)."""
    values, norms = [], []
    for tensor, use_rda in zip(delta, rda, strict=True):
        if use_rda:
            (unit,), (norm,) = unit_directions([tensor])
            values.append(unit)
            norms.append(norm)
        else:
            values.append(tensor)
            norms.append(0.0)
    return values, norms


def rescale(direction: torch.Tensor, norm: float) -> torch.Tensor:
    """``norm * direction / ||direction||`` (zeros for a zero direction): what an RDA member's rounded
    unit direction stands for in the merge, to measure what it could not send (error feedback)."""
    length = float(torch.linalg.vector_norm(direction.detach().to(torch.float64)))
    return direction * (norm / length) if length > 0.0 else torch.zeros_like(direction)


def merge_result(averaged: Tensors, rda: Sequence[bool], norms: Sequence[Sequence[float]],
                 weights: Sequence[float], eps: float = 1e-6) -> list[torch.Tensor]:
    """The merged pseudo-gradient from a round's averaged values: the weighted mean as it is, and
    for RDA tensors the mean direction rescaled to the mean of the members' gathered norms
    (:func:`rda_combine`).

    :param averaged: the round's averaged values per tensor (mean Delta, or mean unit direction)
    :param rda: per tensor, whether it was merged with RDA
    :param norms: per member, its per-tensor norms (from the gathered metadata)
    :param weights: per member, its averaging weight
    """
    if not any(rda):
        return list(averaged)
    nbar = mean_norms(norms, weights)
    merged = []
    for j, (tensor, use_rda) in enumerate(zip(averaged, rda, strict=True)):
        merged.append(rda_combine([tensor], [nbar[j]], eps)[0] if use_rda else tensor)
    return merged


@torch.no_grad()
def outer_step(
    params: Tensors,
    outer_grads: Tensors,
    momentum_buffers: Tensors,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
) -> None:
    """One outer SGD step in place: Theta <- Theta - lr * d (arXiv 2311.08105, Alg. 1, line 14).

    Same update as ``torch.optim.SGD(lr, momentum, nesterov)`` with zero-initialised buffers:
    m <- momentum * m + g; d = g + momentum * m (Nesterov) or d = m. With momentum 0 it is plain
    averaging (FedAvg with server lr ``lr``).

    It is :func:`turn_step` with one group (G = 1).

    :param params: global parameters Theta_p (fp32), updated in place
    :param outer_grads: merged pseudo-gradients, same shapes
    :param momentum_buffers: outer momentum m_p, same shapes, updated in place
    """
    turn_step(params, outer_grads, momentum_buffers, lr=lr, momentum=momentum, nesterov=nesterov, turn=0, turns=1)


@torch.no_grad()
def turn_step(
    params: Tensors,
    outer_grads: Tensors,
    momentum_buffers: Tensors,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    turn: int,
    turns: int,
) -> None:
    """One group's outer step in place when G = ``turns`` groups take turns (docs/DESIGN.md, "Groups
    that take turns"): delayed Nesterov momentum (Liu et al., "Asynchronous Local-SGD Training for
    Language Modeling", arXiv 2401.09135: the momentum moves once per G updates).

    Each turn adds its share g / G to the momentum and (Nesterov) steps Theta by lr g / G; the first
    turn of a period (``turn`` 0) decays the momentum first, the last (``turn`` G - 1) adds the
    momentum term lr * momentum * m (heavy-ball: steps by lr m then, and not at the others). Over the
    G turns of a period with one base this is exactly the one-group step (:func:`outer_step`, G = 1) on
    the mean of the turns' pseudo-gradients. Applied per turn instead,
    momentum on pseudo-gradients up to G - 1 steps stale made training unstable (docs/SCALE.md, E9).

    :param params: global parameters Theta_p (fp32), updated in place
    :param outer_grads: this group's merged pseudo-gradient, same shapes
    :param momentum_buffers: outer momentum m_p, same shapes, updated in place
    :param turn: the slot's place in its period, slot index mod G (0 to G - 1)
    :raises ValueError: ``turn`` outside [0, ``turns``)
    """
    if not 0 <= turn < turns:
        raise ValueError(f"turn {turn} is outside [0, {turns})")
    for param, grad, buf in zip(params, outer_grads, momentum_buffers, strict=True):
        share = grad if turns == 1 else grad * (1.0 / turns)
        if turn == 0:
            buf.mul_(momentum)
        buf.add_(share)
        if nesterov:
            param.sub_((share + buf * momentum if turn == turns - 1 else share) * lr)
        elif turn == turns - 1:
            param.sub_(buf * lr)


@torch.no_grad()
def carry_correction(new_global: Tensors, base: Tensors) -> list[torch.Tensor]:
    """What to add to the island's live parameters so they become Theta_new + (theta_now - base).

    ``base`` is the snapshot whose progress went into the round: the inner progress made after it
    (while the round ran, the overlap of Streaming DiLoCo, arXiv 2501.18512, Sec. 2.3, and eager
    updates, arXiv 2502.12996) is kept on top of the new global parameters instead of being lost.
    """
    return [theta_new - theta_base for theta_new, theta_base in zip(new_global, base, strict=True)]


@torch.no_grad()
def apply_carry(local: Tensors, correction: Tensors) -> None:
    """theta <- theta + (Theta_new - base), in place (see :func:`carry_correction`)."""
    for param, delta in zip(local, correction, strict=True):
        param.add_(delta.to(device=param.device, dtype=param.dtype, non_blocking=True))


@torch.no_grad()
def apply_mix(local: Tensors, new_global: Tensors, alpha: float) -> None:
    """theta <- alpha * theta + (1 - alpha) * Theta_new, in place (Streaming DiLoCo, arXiv 2501.18512,
    Sec. 2.3; alpha = 0 replaces the local parameters, alpha = 0.5 is the paper's choice)."""
    for param, theta_new in zip(local, new_global, strict=True):
        theta_new = theta_new.to(device=param.device, dtype=param.dtype, non_blocking=True)
        param.mul_(alpha).add_(theta_new * (1.0 - alpha))


# ------------------------------------------------------------------------------------------------
# identity of global parameters


def tensors_hash(tensors: Iterable[torch.Tensor]) -> str:
    """A 16-hex-digit blake2b hash of the tensors' bytes (shapes included), e.g. to compare Theta_p."""
    digest = hashlib.blake2b(digest_size=8)
    for tensor in tensors:
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(str(tuple(tensor.shape)).encode())
        if tensor.numel():
            digest.update(memoryview(tensor.numpy()).cast("B"))
    return digest.hexdigest()


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when no element is NaN or infinite."""
    return all(bool(torch.isfinite(tensor).all()) for tensor in tensors)


def canonical_base(bases: Sequence[tuple[int, str]], serving: Optional[Sequence[bool]] = None) -> tuple[int, str]:
    """The base (version, Theta hash) a round's result is applied to.

    In a group of 3 or more, only bases that 2 or more members hold count when there are any: one
    member cannot make the others drop their base by claiming a newer version (docs/SECURITY.md).
    Among those, the newest version wins; among forks of that version, the one most members hold;
    then the smaller hash. Every member computes the same answer from the same gathered metadata;
    members whose base differs reload the fragment from a member holding the result (docs/DESIGN.md,
    "Syncer", step 4).

    :param serving: per base, whether its holder serves state (False: a client-mode member, which
        nobody can dial). A result only clients hold could reach no member that missed it, so when
        some member serves, only bases that a serving member holds count (docs/DESIGN.md, "Islands
        behind NAT": clients take their state from full members anyway)
    :raises ValueError: if ``bases`` is empty, or ``serving`` is not one flag per base
    """
    if not bases:
        raise ValueError("no bases to choose from")
    if serving is not None and len(serving) != len(bases):
        raise ValueError(f"{len(serving)} serving flags for {len(bases)} bases")
    counts: dict[tuple[int, str], int] = {}
    for base in bases:
        counts[base] = counts.get(base, 0) + 1
    served = {base for base, serves in zip(bases, serving or [True] * len(bases)) if serves}
    shared = [base for base, count in counts.items() if count >= 2] if len(bases) >= 3 else []
    candidates = shared or list(counts)
    if served:
        candidates = [base for base in candidates if base in served] or [base for base in counts if base in served]
    return max(candidates, key=lambda base: (base[0], counts[base], _reverse(base[1])))


def vouched(bases: Sequence[tuple[int, str]]) -> list[tuple[int, str]]:
    """The reported bases (version, Theta hash) that 2 or more reporters hold when 2 or more report,
    else the only one: what an island may load from others' records (a joiner's state, a repair's
    newer version), so that no one island's word decides what another loads (docs/SECURITY.md).
    Duplicates are kept (one entry per holder), as :func:`canonical_base` counts them.

    :param bases: one entry per reporting island
    """
    counts: dict[tuple[int, str], int] = {}
    for base in bases:
        counts[base] = counts.get(base, 0) + 1
    needed = 2 if len(bases) >= 2 else 1
    return [base for base in bases if counts[base] >= needed]


def _reverse(text: str) -> tuple[int, ...]:
    return tuple(-ord(ch) for ch in text)
