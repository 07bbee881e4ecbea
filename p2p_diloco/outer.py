"""The outer-loop maths, with no networking: pseudo-gradients, weights, the outer optimizer, how a
round's result lands on the island, and the exact-average encoding used on the wire.

All tensors here are fp32 CPU tensors given as sequences in fragment order.

Determinism: members of a round must end with bitwise identical global parameters, including on
different CPUs. Every update below is therefore written as separate multiplies and adds (each
rounded once, as IEEE 754 prescribes), never as ``add(..., alpha=x)`` or ``addcmul``, which some
kernels fuse into one FMA on some processors and not on others.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterable, Optional, Sequence, Union

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

    :param params: global parameters Theta_p (fp32), updated in place
    :param outer_grads: merged pseudo-gradients, same shapes
    :param momentum_buffers: outer momentum m_p, same shapes, updated in place
    """
    for param, grad, buf in zip(params, outer_grads, momentum_buffers, strict=True):
        buf.mul_(momentum).add_(grad)
        direction = grad + buf * momentum if nesterov else buf
        param.sub_(direction * lr)


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
# exact averaging on the wire


def wire_offset(max_delta: float) -> float:
    """The power of two C >= 4 * max_delta that pseudo-gradients are shifted by on the wire.

    :raises ValueError: if max_delta is not positive
    """
    if not max_delta > 0:
        raise ValueError(f"max_delta must be positive, got {max_delta}")
    return 2.0 ** math.ceil(math.log2(4.0 * max_delta))


@torch.no_grad()
def clip_(tensors: Tensors, bound: float) -> int:
    """Clamp every element to [-bound, bound] in place; returns how many elements were clipped.

    A sanity bound on pseudo-gradients (``outer.max_delta``): a healthy outer gradient is far below
    it, and the wire encoding needs |Delta| <= C/4.
    """
    clipped = 0
    for tensor in tensors:
        clipped += int((tensor.abs() > bound).sum())
        tensor.clamp_(-bound, bound)
    return clipped


def _per_tensor(value: Union[float, Sequence[float]], count: int) -> list[float]:
    """One value per tensor: a number for all of them, or a sequence with one each."""
    if isinstance(value, (int, float)):
        return [float(value)] * count
    if len(value) != count:
        raise ValueError(f"{len(value)} values for {count} tensors")
    return [float(v) for v in value]


@torch.no_grad()
def encode_for_wire(delta: Tensors, out: Tensors, offset: Union[float, Sequence[float]]) -> None:
    """out <- C + Delta: what a member puts into the averaged tensors. Requires |Delta| <= C/4
    (apply :func:`clip_` with a bound of at most ``offset / 4`` first). ``offset``: C for every
    tensor, or one C per tensor.

    hivemind's all-reduce hands each member ``y_i + (avg - y_i)``, computed in fp32. Because every
    value lies in [0.75 C, 1.25 C], within a factor of two of every other, ``avg - y_i`` is exact
    (Sterbenz lemma) and so is ``y_i + (avg - y_i) == avg``: all members receive the same bits, so
    members that start from the same Theta end with the same Theta. The price is absolute precision
    of C * 2^-24 on each element. The argument needs uncompressed fp32 on the wire and every part of
    the all-reduce to succeed; a part whose reducer failed leaves each member its own values, which
    :func:`find_unaveraged` finds (and the island's base check repairs what differs all the same).
    """
    for source, target, c in zip(delta, out, _per_tensor(offset, len(out)), strict=True):
        torch.add(source, c, out=target)


@torch.no_grad()
def find_unaveraged(received: Tensors, sent: Tensors, min_run: int = 1024) -> Optional[list[torch.Tensor]]:
    """The parts of a round's result that no reducer averaged, as boolean masks shaped like the
    tensors (None when there are none).

    hivemind's all-reduce drops a member that stops answering mid-round (a frozen or cut-off island)
    instead of failing the whole group: senders that miss ``sender_timeout`` are left out of the
    average, and each member keeps *its own* values for the part a failed reducer owned. Those
    parts differ from member to member; the syncer sets the merged pseudo-gradient there to zero
    (Theta moves only by the outer momentum there, the same on every member that saw the same
    failure) and, with ``apply = "carry"``, keeps the island's local progress there for the next
    round.

    A failed part is a contiguous run of elements (in hivemind's flattened order: the tensors in
    sequence) where the result equals exactly what this member sent. Averaged elements equal it
    where every member sent the same value (every member then finds them alike), and where the
    other members' weight is too small to move a value by half a step (a listener's 1e-12): the
    caller does not check such rounds. ``min_run`` (elements) keeps isolated coincidences out; a
    failed part shorter than it is not found (that member then keeps its own values there, and the
    base check repairs the fork).

    :param received: the round's result in value space (after :func:`decode_from_wire` or
        ``wire.from_wire``), fp32
    :param sent: what this member sent, in the same space and shapes
    :param min_run: shortest run of unchanged elements taken for a failed part
    """
    if not received:
        return None
    same = torch.cat([(r == s).reshape(-1) for r, s in zip(received, sent, strict=True)])
    if not bool(same.any()):
        return None
    # run boundaries of `same`: +1 where a run starts, -1 one past where it ends
    padded = torch.cat([torch.zeros(1, dtype=torch.int8), same.to(torch.int8), torch.zeros(1, dtype=torch.int8)])
    edges = torch.diff(padded)
    starts, ends = torch.nonzero(edges == 1).flatten(), torch.nonzero(edges == -1).flatten()
    long = (ends - starts) >= min_run
    if not bool(long.any()):
        return None
    drop = torch.zeros(same.numel(), dtype=torch.bool)
    for start, end in zip(starts[long].tolist(), ends[long].tolist()):
        drop[start:end] = True
    masks, position = [], 0
    for tensor in received:
        masks.append(drop[position:position + tensor.numel()].view_as(tensor))
        position += tensor.numel()
    return masks


def wire_bound(max_delta: float, offset: float) -> float:
    """The largest |merged pseudo-gradient| honest members can produce: max_delta plus rounding."""
    return max_delta * (1.0 + 1e-6) + 8.0 * offset * 2.0**-24


@torch.no_grad()
def max_abs_sent(wire: Tensors, offset: Union[float, Sequence[float]]) -> float:
    """max |y - C| over what a member put on the wire (NaN or Inf if it sent such values)."""
    values = [float((tensor - c).abs().max()) for tensor, c in zip(wire, _per_tensor(offset, len(wire))) if tensor.numel()]
    if any(math.isnan(v) for v in values):
        return float("nan")
    return max(values, default=0.0)


@torch.no_grad()
def within_bound(tensors: Tensors, bound: Union[float, Sequence[float]]) -> bool:
    """True when every element is finite and within [-bound, bound] (one bound, or one per tensor):
    a merged pseudo-gradient that is not could only come from a member that sent garbage (NaN, Inf,
    unclipped huge values)."""
    return all(bool(torch.isfinite(t).all()) and (t.numel() == 0 or float(t.abs().max()) <= b)
               for t, b in zip(tensors, _per_tensor(bound, len(tensors))))


@torch.no_grad()
def corrupt_(wire: Tensors, kind: str) -> None:
    """Testing only: overwrite what goes on the wire with NaN, Inf or 1e30, as a faulty island would."""
    value = {"nan": float("nan"), "inf": float("inf"), "huge": 1e30}[kind]
    for tensor in wire:
        tensor.fill_(value)


@torch.no_grad()
def wire_roundtrip(values: Tensors, offset: Union[float, Sequence[float]]) -> list[torch.Tensor]:
    """(C + v) - C: the value a member actually sent with :func:`encode_for_wire` (v rounded to the
    wire's absolute precision C * 2^-24), comparable with :func:`decode_from_wire`'s result."""
    return [(tensor + c) - c for tensor, c in zip(values, _per_tensor(offset, len(values)))]


@torch.no_grad()
def decode_from_wire(averaged: Tensors, offset: Union[float, Sequence[float]]) -> list[torch.Tensor]:
    """The merged pseudo-gradient avg - C (exact, by the same argument as :func:`encode_for_wire`)."""
    return [tensor - c for tensor, c in zip(averaged, _per_tensor(offset, len(averaged)))]


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


def canonical_base(bases: Sequence[tuple[int, str]]) -> tuple[int, str]:
    """The base (version, Theta hash) a round's result is applied to.

    The newest version wins; among forks of that version, the one most members hold; then the
    smaller hash. Every member computes the same answer from the same gathered metadata; members
    whose base differs reload the fragment from a member holding the result (DESIGN.md, syncer
    step 4).

    :raises ValueError: if ``bases`` is empty
    """
    if not bases:
        raise ValueError("no bases to choose from")
    counts: dict[tuple[int, str], int] = {}
    for base in bases:
        counts[base] = counts.get(base, 0) + 1
    return max(counts, key=lambda base: (base[0], counts[base], _reverse(base[1])))


def _reverse(text: str) -> tuple[int, ...]:
    return tuple(-ord(ch) for ch in text)
