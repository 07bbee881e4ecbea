"""Exact averaging on the wire, pure maths: what a member writes into the averaged buffers so that
hivemind's fp32 all-reduce returns the same bits to every member (``C + Delta``, Sterbenz), the
bounds an honest group's result stays within, and how to find the parts no reducer averaged.

All tensors are fp32 CPU tensors given as sequences in fragment order. Low-bit rounds use
:mod:`p2p_diloco.algo.grid` instead.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

Tensors = Sequence[torch.Tensor]



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
def wire_roundtrip(values: Tensors, offset: Union[float, Sequence[float]]) -> list[torch.Tensor]:
    """(C + v) - C: the value a member actually sent with :func:`encode_for_wire` (v rounded to the
    wire's absolute precision C * 2^-24), comparable with :func:`decode_from_wire`'s result."""
    return [(tensor + c) - c for tensor, c in zip(values, _per_tensor(offset, len(values)))]


@torch.no_grad()
def decode_from_wire(averaged: Tensors, offset: Union[float, Sequence[float]]) -> list[torch.Tensor]:
    """The merged pseudo-gradient avg - C (exact, by the same argument as :func:`encode_for_wire`)."""
    return [tensor - c for tensor, c in zip(averaged, _per_tensor(offset, len(averaged)))]
