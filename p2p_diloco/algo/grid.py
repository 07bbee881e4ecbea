"""Outer gradients on the wire, pure maths: low-bit grids that keep members identical and lossless
wire formats for their values (no networking).

**Quantization** (fp16, bf16, int8, int4, int2; Streaming DiLoCo, arXiv 2501.18512, Sec. 2.4, sends
4-bit outer gradients). Each member quantizes its pseudo-gradient onto a grid of step s = 2^e per
chunk of :data:`CHUNK` elements, with |code| <= L levels (int4: L = 7). The grid is *shared by the
round's members*: every member reports the exponents it needs in the round's gathered metadata and
all use the largest (:func:`shared_exponents`, computed in each member's averager once the group is
known). On the wire a value is y = 1.5 * 2^(e+23) + q: all values of a chunk then lie in one fp32
binade whose spacing is s / 2^GUARD_BITS (s / 4), so

- the reducer's fp32 weighted average A of the members' y is rounded to that spacing (each of its
  fp32 additions rounds relative to the sum, so A carries about 0.2 s of rounding per member; the
  finer binade keeps this below the grid's own quantization error),
- the reply ``A - y_i`` that hivemind sends back to each member is exact (Sterbenz lemma), and
- every member ends with the same bits ``y_i + (A - y_i) == A``, whatever its own values.

Members starting from the same Theta therefore still end with the same Theta after a compressed
round, as with uncompressed rounds (:func:`p2p_diloco.algo.wire.encode_for_wire`). What a member could
not send (``Delta - q``) stays in its local parameters and goes into its next round (error feedback
through the syncer's carry base; with ``apply = "mix"`` there is no carry base and the error is
dropped). The grid a round used is written by the averager into shared memory and read back by the
island, so the two never disagree; member reports are capped at what an honest member can need.

**Wire formats**: :func:`encode_grid` packs such values losslessly (pure functions, bytes <->
flat fp32): a chunk's uplink values need ceil(log2(2L+1)) bits (4 for int4), the replies at most
GUARD_BITS + 1 more (7 for int4, fewer where a block's values are small), so an int4 round moves
about 7x fewer bytes than an fp32 one. The hivemind codecs that frame them are in
:mod:`p2p_diloco.net.codec`.
"""

from __future__ import annotations

import struct
from typing import Optional, Sequence

import numpy as np
import torch

LEVELS = {"fp16": 2047, "bf16": 255, "int8": 127, "int4": 7, "int2": 1}
CODECS = ("none",) + tuple(LEVELS)
CHUNK = 1024  # elements per quantization scale
EMPTY_EXPONENT = -120  # an all-zero chunk (and the finest step: its wire values stay normal fp32 numbers)
TOP_EXPONENT = 100  # a chunk with NaN/Inf or absurd values: the round's result is rejected anyway
BLOCK = 256  # elements per block of the signed-grid wire format (its own step and bit width)
GUARD_BITS = 2  # the wire binade is 2^GUARD_BITS times finer than the grid: the reducer's fp32 sums round less

MAX_MESSAGE_VALUES = 1 << 30  # a tensor part larger than this is refused before decoding

_RAW, _BINADE, _BLOCKS = 0, 1, 2


# ------------------------------------------------------------------------------------------------
# shared grids


def levels_of(codec: str) -> int:
    """L, the largest |code| of a codec (0 for ``none``).

    :raises ValueError: for an unknown codec name
    """
    if codec == "none":
        return 0
    if codec not in LEVELS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")
    return LEVELS[codec]


def chunk_exponents(tensor: torch.Tensor, levels: int) -> torch.Tensor:
    """Per chunk of :data:`CHUNK` elements (flattened; the last may be short), the smallest e with
    ``levels * 2^e >= max|x|``: the step a member needs to send the chunk without clipping.

    :param tensor: any shape, fp32
    :returns: int16 of shape (ceil(numel / CHUNK),); :data:`EMPTY_EXPONENT` for all-zero chunks and
        :data:`TOP_EXPONENT` for chunks with NaN, Inf or values beyond 2^TOP
    """
    flat = tensor.detach().reshape(-1).to(torch.float64)
    pad = (-flat.numel()) % CHUNK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    amax = flat.view(-1, CHUNK).abs().amax(dim=1)
    finite = torch.isfinite(amax)
    ratio = torch.where(finite & (amax > 0), amax / levels, torch.ones_like(amax))
    exponent = torch.ceil(torch.log2(ratio)).clamp(EMPTY_EXPONENT, TOP_EXPONENT)
    # log2 may be off by one at exact powers of two: settle it with exact comparisons
    exponent = torch.where(levels * torch.exp2(exponent) < amax, exponent + 1, exponent)
    exponent = torch.where(levels * torch.exp2(exponent - 1) >= amax, exponent - 1, exponent)
    exponent = torch.where(amax > 0, exponent.clamp(EMPTY_EXPONENT, TOP_EXPONENT), float(EMPTY_EXPONENT))
    exponent = torch.where(finite, exponent, float(TOP_EXPONENT))
    return exponent.to(torch.int16)


def exponents_report(tensors: Sequence[torch.Tensor], levels: int) -> bytes:
    """The exponents a member needs for all its tensors, as bytes for the round's gathered metadata."""
    if not tensors:
        return b""
    return torch.cat([chunk_exponents(t, levels) for t in tensors]).numpy().astype("<i2").tobytes()


def shared_exponents(reports: Sequence, shapes: Sequence[torch.Size],
                     ceilings: Optional[Sequence[int]] = None) -> list[torch.Tensor]:
    """The round's grid: per tensor and chunk, the largest exponent any member reported (so no member
    clips), capped at the tensor's ceiling (what an honest member can need: a member that reports
    more cannot coarsen everyone's grid beyond it, and the syncer flags it). Reports that are not
    bytes of the right length (a malformed member) are ignored; with none left, every chunk gets
    :data:`TOP_EXPONENT` (a grid so coarse the round carries nothing). Every member computes the same
    result from the same gathered metadata.

    :param reports: :func:`exponents_report` of each member
    :param shapes: the shapes of the averaged tensors
    :param ceilings: per tensor, the largest exponent allowed (:func:`ceiling_exponent`), or None
    :returns: int16 tensors, one per tensor, of shape (ceil(numel / CHUNK),)
    """
    counts = _chunk_counts(shapes)
    total = sum(counts)
    valid = [np.frombuffer(r, dtype="<i2") for r in reports if isinstance(r, (bytes, bytearray)) and len(r) == 2 * total]
    merged = np.max(np.stack(valid), axis=0) if valid else np.full(total, TOP_EXPONENT, dtype=np.int16)
    merged = np.clip(merged, EMPTY_EXPONENT, TOP_EXPONENT).astype(np.int16)
    parts = [torch.from_numpy(part.copy()) for part in np.split(merged, np.cumsum(counts)[:-1])] if counts else []
    if ceilings is not None:
        parts = [part.clamp(max=int(ceiling)) for part, ceiling in zip(parts, ceilings, strict=True)]
    return parts


def ceiling_exponent(bound: float, levels: int) -> int:
    """The exponent a chunk needs when its largest |value| is ``bound`` (e.g. max_delta, or 1 for
    unit directions): no honest member reports more."""
    return int(chunk_exponents(torch.tensor([float(bound)]), levels)[0])


def within_grid(values: torch.Tensor, exponents: torch.Tensor, levels: int) -> bool:
    """True when every element is finite and within (L + 1) steps of zero for its chunk: a round's
    result on the grid is a weighted mean of values within L steps, so anything else came from a
    member that did not put its values on the grid (and may not be exactly representable)."""
    flat = values.detach().reshape(-1).to(torch.float64)
    limit = (levels + 1) * torch.exp2(_per_element(exponents, flat.numel()))
    return bool(torch.isfinite(flat).all()) and bool((flat.abs() <= limit).all())


def _per_element(exponents: torch.Tensor, numel: int) -> torch.Tensor:
    return exponents.to(torch.float64).repeat_interleave(CHUNK)[:numel]


def quantize(tensor: torch.Tensor, exponents: torch.Tensor, levels: int) -> torch.Tensor:
    """q = clamp(floor(x / s + 1/2), -L, L) * s per chunk with s = 2^e: the nearest grid value
    (ties upwards), clipped to the grid's range. Exact arithmetic (float64, powers of two), so every
    process computes the same bits. Round-trip error: at most s / 2 for |x| <= L * s.

    :param tensor: any shape, fp32; NaN stays NaN
    :param exponents: int16, one per chunk (from :func:`chunk_exponents` or :func:`shared_exponents`)
    :returns: fp32, same shape
    """
    scale = torch.exp2(_per_element(exponents, tensor.numel()))
    codes = torch.floor(tensor.detach().reshape(-1).to(torch.float64) / scale + 0.5).clamp(-levels, levels)
    return (codes * scale).to(torch.float32).view_as(tensor)


def _centre(exponents: torch.Tensor, numel: int) -> torch.Tensor:
    """1.5 * 2^(e + 23 - GUARD_BITS) per element: the middle of a binade whose spacing is s / 2^GUARD_BITS."""
    return 1.5 * torch.exp2(_per_element(exponents, numel) + (23 - GUARD_BITS))


def to_wire(q: torch.Tensor, exponents: torch.Tensor, out: torch.Tensor) -> None:
    """out <- centre + q, exact for q on the chunk's grid with |q| < 2^(e + 22 - GUARD_BITS)."""
    centre = _centre(exponents, q.numel())
    out.copy_((centre + q.reshape(-1).to(torch.float64)).to(torch.float32).view_as(out))


def from_wire(y: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """y - centre: the value of a wire element (exact within the chunk's binade)."""
    centre = _centre(exponents, y.numel())
    return (y.reshape(-1).to(torch.float64) - centre).to(torch.float32).view_as(y)


def put_on_grid_(tensors: Sequence[torch.Tensor], reports: Sequence, levels: int,
                 ceilings: Optional[Sequence[int]] = None) -> torch.Tensor:
    """In the averager, once the group is known: replace each raw value x in ``tensors`` (in place)
    by its wire value on the round's shared grid, ``to_wire(quantize(x))``.

    :returns: the grid used (int16, every tensor's chunk exponents in sequence), for the island
    """
    grid = shared_exponents(reports, [t.shape for t in tensors], ceilings)
    for tensor, exponents in zip(tensors, grid):
        to_wire(quantize(tensor, exponents, levels), exponents, tensor)
    return torch.cat(grid) if grid else torch.zeros(0, dtype=torch.int16)


def split_grid(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """The per-tensor chunk exponents of a grid returned by :func:`put_on_grid_`."""
    return [part.clone() for part in torch.split(flat, _chunk_counts(shapes))]


def num_chunks(shapes: Sequence[torch.Size]) -> int:
    """Chunks of :data:`CHUNK` elements over all tensors (each tensor's last chunk may be short)."""
    return sum(_chunk_counts(shapes))


def _chunk_counts(shapes: Sequence[torch.Size]) -> list[int]:
    """Chunks of each tensor (its last chunk may be short)."""
    return [-(-int(np.prod(shape, dtype=np.int64)) // CHUNK) for shape in shapes]


# ------------------------------------------------------------------------------------------------
# bit packing


def pack_bits(codes: np.ndarray, width: int) -> bytes:
    """Unsigned integer codes (< 2^width, any length) as a little-endian bit stream of ``width`` bits
    each (1..56), padded to whole bytes."""
    if width == 0 or codes.size == 0:
        return b""
    codes = codes.astype(np.uint64, copy=False).reshape(-1)
    bits = ((codes[:, None] >> np.arange(width, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def unpack_bits(buffer: bytes, width: int, count: int) -> np.ndarray:
    """The ``count`` codes of :func:`pack_bits`, as int64."""
    if width == 0 or count == 0:
        return np.zeros(count, dtype=np.int64)
    bits = np.unpackbits(np.frombuffer(buffer, dtype=np.uint8), count=count * width, bitorder="little")
    return (bits.reshape(count, width).astype(np.int64) << np.arange(width, dtype=np.int64)).sum(axis=1)


def _bit_length(values: np.ndarray) -> np.ndarray:
    """Bits needed for each non-negative integer (0 for 0)."""
    out = np.zeros(values.shape, dtype=np.int64)
    nonzero = values > 0
    out[nonzero] = np.floor(np.log2(values[nonzero].astype(np.float64))).astype(np.int64) + 1
    # float log2 may misjudge values just below a power of two: fix with exact integer checks
    out[nonzero & ((np.int64(1) << np.maximum(out, 0)) <= values)] += 1
    out[nonzero & ((np.int64(1) << np.maximum(out - 1, 0)) > values)] -= 1
    return out


def _lowest_bit_exponents(values: np.ndarray) -> np.ndarray:
    """For nonzero finite float64 values, the exponent of their lowest set bit (v = odd * 2^that)."""
    mantissa, exponent = np.frexp(np.abs(values))
    integer = np.ldexp(mantissa, 53).astype(np.int64)
    low = integer & -integer
    return exponent.astype(np.int64) - 53 + (np.frexp(low.astype(np.float64))[1].astype(np.int64) - 1)


# ------------------------------------------------------------------------------------------------
# wire formats (pure functions: bytes <-> flat fp32)


def encode_raw(flat: np.ndarray) -> bytes:
    """Plain fp32: a one-byte header and 4 bytes per value."""
    return bytes([_RAW]) + flat.astype("<f4", copy=False).tobytes()


def encode_grid(flat: np.ndarray) -> bytes:
    """Lossless packing of fp32 values that lie on power-of-two grids (anything else falls back to
    raw fp32, so decoding always returns the exact input):

    - *binade* format, when every value is positive and normal: per run of values in one fp32
      binade [2^b, 2^(b+1)), codes k = (y - 1.5 * 2^b) / 2^(b-23) with one bit width for the part
      (what members send: 4 bits per value for int4);
    - *blocks* format otherwise: per block of :data:`BLOCK` values, the block's coarsest common
      power-of-two step g and signed codes x / g, each block with its own bit width (what reducers
      send back: 5 to 7 bits per value for int4).

    Decoding returns the input bit for bit, except that -0.0 comes back as +0.0 in the blocks format.
    """
    flat = flat.astype(np.float32, copy=False).reshape(-1)
    if flat.size == 0 or not np.isfinite(flat).all():
        return encode_raw(flat)
    values = flat.astype(np.float64)
    tiny = np.finfo(np.float32).tiny
    if (values >= tiny).all():
        payload = _encode_binade(values)
    else:
        payload = _encode_blocks(values)
    if payload is None or len(payload) >= 4 * flat.size + 1:
        return encode_raw(flat)
    return payload


def _encode_binade(values: np.ndarray) -> Optional[bytes]:
    binade = np.frexp(values)[1].astype(np.int64) - 1  # values in [2^b, 2^(b+1))
    codes = (np.ldexp(values, (23 - binade).astype(np.int32)) - 1.5 * 2.0**23).astype(np.int64)  # in [-2^22, 2^22)
    nonzero = codes[codes != 0]
    shift = int(_lowest_bit_exponents(nonzero.astype(np.float64)).min()) if nonzero.size else 0
    codes >>= shift  # codes on a coarser grid than the binade's spacing (GUARD_BITS) lose their zero bits
    width = int(_bit_length(np.abs(codes)).max()) + 1
    starts = np.flatnonzero(np.diff(binade, prepend=binade[0] - 1))
    header = struct.pack("<BBBII", _BINADE, width, shift, values.size, starts.size)
    runs = starts.astype("<u4").tobytes() + binade[starts].astype("<i2").tobytes()
    return header + runs + pack_bits(codes + (np.int64(1) << (width - 1)), width)


def _encode_blocks(values: np.ndarray) -> Optional[bytes]:
    count = values.size
    pad = (-count) % BLOCK
    padded = np.concatenate([values, np.zeros(pad)]) if pad else values
    blocks = padded.reshape(-1, BLOCK)
    nonzero = blocks != 0
    lowest = np.where(nonzero, _lowest_bit_exponents(np.where(nonzero, blocks, 1.0)), np.iinfo(np.int64).max)
    step = np.where(nonzero.any(axis=1), lowest.min(axis=1), 0)
    if (step < -1100).any() or (step > 1100).any():
        return None
    codes = np.ldexp(blocks, (-step[:, None]).astype(np.int32))  # exact integers
    magnitude = np.abs(codes).max(axis=1)
    if (magnitude >= 2.0**52).any():
        return None  # values too far apart for one block's integer codes
    widths = np.where(magnitude > 0, _bit_length(magnitude.astype(np.int64)) + 1, 0)
    parts = [struct.pack("<BI", _BLOCKS, count), step.astype("<i2").tobytes(), widths.astype("u1").tobytes()]
    for width in np.unique(widths):
        if width:
            chosen = codes[widths == width].astype(np.int64) + (np.int64(1) << (int(width) - 1))
            parts.append(pack_bits(chosen, int(width)))
    return b"".join(parts)


def decode(payload: bytes, expected: Optional[int] = None) -> np.ndarray:
    """The flat fp32 values of :func:`encode_raw` or :func:`encode_grid` output.

    :param expected: the number of values the message must hold (its tensor's size), checked before
        anything is allocated, so that a short malicious message cannot claim billions of values
    :raises ValueError: for a payload in no known format, or whose sizes do not add up
    """
    if not payload:
        raise ValueError("empty payload")
    kind = payload[0]
    if kind == _RAW:
        if expected is not None and len(payload) != 1 + 4 * expected:
            raise ValueError(f"raw payload of {len(payload)} bytes for {expected} values")
        return np.frombuffer(payload, dtype="<f4", offset=1).copy()
    if kind == _BINADE:
        width, shift, count, runs = struct.unpack_from("<BBII", payload, 1)
        at = 11
        if (expected is not None and count != expected) or not 1 <= width <= 56 or runs > count or (
                len(payload) != at + 6 * runs + -(-count * width // 8)):
            raise ValueError("malformed binade payload")
        starts = np.frombuffer(payload, dtype="<u4", count=runs, offset=at).astype(np.int64)
        binades = np.frombuffer(payload, dtype="<i2", count=runs, offset=at + 4 * runs).astype(np.int64)
        at += 6 * runs
        lengths = np.diff(np.append(starts, count))
        binade = np.repeat(binades, lengths)
        codes = (unpack_bits(payload[at:], width, count) - (np.int64(1) << (width - 1))) << shift
        return np.ldexp(codes.astype(np.float64) + 1.5 * 2.0**23, (binade - 23).astype(np.int32)).astype(np.float32)
    if kind == _BLOCKS:
        (count,) = struct.unpack_from("<I", payload, 1)
        num_blocks = -(-count // BLOCK)
        at = 5
        if (expected is not None and count != expected) or len(payload) < at + 3 * num_blocks:
            raise ValueError("malformed blocks payload")
        step = np.frombuffer(payload, dtype="<i2", count=num_blocks, offset=at).astype(np.int64)
        widths = np.frombuffer(payload, dtype="u1", count=num_blocks, offset=at + 2 * num_blocks).astype(np.int64)
        at += 3 * num_blocks
        sizes = {int(w): -(-int((widths == w).sum()) * BLOCK * int(w) // 8) for w in np.unique(widths) if w}
        if widths.max(initial=0) > 56 or len(payload) != at + sum(sizes.values()):
            raise ValueError("malformed blocks payload")
        codes = np.zeros((num_blocks, BLOCK), dtype=np.int64)
        for width in np.unique(widths):
            if width:
                chosen = widths == width
                n = int(chosen.sum()) * BLOCK
                nbytes = -(-n * int(width) // 8)
                unpacked = unpack_bits(payload[at:at + nbytes], int(width), n) - (np.int64(1) << (int(width) - 1))
                codes[chosen] = unpacked.reshape(-1, BLOCK)
                at += nbytes
        return np.ldexp(codes.astype(np.float64), step[:, None].astype(np.int32)).reshape(-1)[:count].astype(np.float32)
    raise ValueError(f"unknown wire format {kind}")
