"""Low-bit codes for outer gradients: uniform integer codes with one scale per chunk, and E3M0
(sign and a 3-bit power-of-two exponent, Streaming DiLoCo's 4-bit format, arXiv 2501.18512,
Sec. 2.4), packed into bytes. Pure maths on CPU tensors, no networking: reference codes with
per-member scales. Rounds do not use them: a member-specific scale cannot keep a round's members
bit-identical through hivemind's all-reduce, so rounds quantize onto grids shared by the round's
members instead (:mod:`p2p_diloco.wire`, uniform codes only).

Shapes: every function takes or returns a flat view; ``numel`` restores the element count, and the
caller reshapes. Scales are fp32, one per chunk of ``chunk`` elements (the last chunk may be short).
"""

from __future__ import annotations

import math

import torch

CODES = ("uniform", "e3m0")


def _chunks(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, int]:
    """x (flat, fp32) zero-padded to whole chunks, as (num_chunks, chunk), and the padding length."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    flat = x.detach().reshape(-1).to(torch.float32)
    pad = (-flat.numel()) % chunk
    if pad:
        flat = torch.cat([flat, torch.zeros(pad, dtype=torch.float32)])
    return flat.view(-1, chunk), pad


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes (< 2**bits, any integer dtype, flat) into uint8, 8 // bits per byte,
    lowest bits first. ``bits`` is 1, 2, 4 or 8."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"can only pack 1, 2, 4 or 8 bits per code, got {bits}")
    codes = codes.reshape(-1).to(torch.uint8)
    per_byte = 8 // bits
    pad = (-codes.numel()) % per_byte
    if pad:
        codes = torch.cat([codes, torch.zeros(pad, dtype=torch.uint8)])
    codes = codes.view(-1, per_byte)
    packed = torch.zeros(codes.shape[0], dtype=torch.uint8)
    for slot in range(per_byte):
        packed |= codes[:, slot] << (slot * bits)
    return packed


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The first ``numel`` codes of :func:`pack`'s output, as uint8."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"can only unpack 1, 2, 4 or 8 bits per code, got {bits}")
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    slots = [(packed >> (slot * bits)) & mask for slot in range(per_byte)]
    return torch.stack(slots, dim=1).reshape(-1)[:numel]


def quantize_uniform(x: torch.Tensor, bits: int, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric uniform codes: per chunk, scale = max|x| / (2**(bits-1) - 1) and
    q = round(x / scale), stored offset by 2**(bits-1) - 1 so codes are unsigned.

    Round-trip error per element: at most scale / 2, i.e. max|x over its chunk| / (2**bits - 2).

    :param x: any shape, fp32 (finite: NaN/Inf must be rejected before)
    :param bits: 2 to 8
    :returns: (packed codes, uint8; scales, fp32 of shape (num_chunks,))
    :raises ValueError: for other bit widths or a chunk below 1
    """
    if not 2 <= bits <= 8:
        raise ValueError(f"uniform codes need 2 to 8 bits, got {bits}")
    rows, _ = _chunks(x, chunk)
    levels = (1 << (bits - 1)) - 1
    scales = rows.abs().amax(dim=1) / levels
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp_(-levels, levels).to(torch.int16) + levels
    return pack(q.reshape(-1)[: x.numel()], _storage_bits(bits)), scales


def dequantize_uniform(packed: torch.Tensor, scales: torch.Tensor, bits: int, numel: int, chunk: int = 1024) -> torch.Tensor:
    """The fp32 values (flat, ``numel`` elements) of :func:`quantize_uniform`'s output."""
    levels = (1 << (bits - 1)) - 1
    q = _padded(unpack(packed, _storage_bits(bits), numel).to(torch.float32) - levels, scales.numel() * chunk)
    return (q.view(-1, chunk) * scales[:, None]).reshape(-1)[:numel]


E3M0_MIN_EXPONENT = -6  # magnitudes scale * 2^e for e in -6..0; exponent code 0 is zero


def quantize_e3m0(x: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit E3M0 codes: a sign bit and a 3-bit exponent code k (0: zero; 1..7: magnitude
    scale * 2^(k - 7)), with scale = max|x| per chunk. Each magnitude goes to the nearer of its two
    neighbouring levels (linear distance), so the round-trip error per element is at most |x| / 3,
    or scale * 2^-7 below the smallest level.

    :param x: any shape, fp32 (finite)
    :returns: (packed codes, uint8, two per byte; scales, fp32 of shape (num_chunks,))
    """
    rows, _ = _chunks(x, chunk)
    scales = rows.abs().amax(dim=1)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    ratio = rows.abs() / safe[:, None]  # in [0, 1]
    # candidate levels below and above: 2^floor(log2 r) and twice that, limited to 2^-6 .. 2^0
    low_exp = torch.floor(torch.log2(ratio.clamp(min=2.0 ** (E3M0_MIN_EXPONENT - 1)))).clamp_(
        E3M0_MIN_EXPONENT - 1, 0)
    low = torch.where(low_exp < E3M0_MIN_EXPONENT, torch.zeros_like(ratio), torch.exp2(low_exp))
    high = torch.exp2((low_exp + 1).clamp(max=0))
    use_high = (high - ratio) < (ratio - low)
    exponent = torch.where(use_high, (low_exp + 1).clamp(max=0), low_exp)
    level_code = torch.where(~use_high & (low_exp < E3M0_MIN_EXPONENT), torch.zeros_like(exponent),
                             exponent - E3M0_MIN_EXPONENT + 1).to(torch.uint8)  # 0 (zero) or 1..7
    sign = (rows < 0).to(torch.uint8)
    return pack(((sign << 3) | level_code).reshape(-1)[: x.numel()], 4), scales


def dequantize_e3m0(packed: torch.Tensor, scales: torch.Tensor, numel: int, chunk: int = 1024) -> torch.Tensor:
    """The fp32 values (flat, ``numel`` elements) of :func:`quantize_e3m0`'s output."""
    codes = _padded(unpack(packed, 4, numel), scales.numel() * chunk).view(-1, chunk)
    level_code = (codes & 0x7).to(torch.float32)
    magnitude = torch.where(level_code > 0, torch.exp2(level_code - 1 + E3M0_MIN_EXPONENT), torch.zeros_like(level_code))
    signed = torch.where((codes >> 3) > 0, -magnitude, magnitude)
    return (signed * scales[:, None]).reshape(-1)[:numel]


def payload_bytes(numel: int, code: str, bits: int = 4, chunk: int = 1024) -> int:
    """Bytes on the wire for ``numel`` values in a code: packed codes plus one fp32 scale per chunk
    (``code`` "uniform" with ``bits``, or "e3m0", always 4 bits)."""
    if code not in CODES:
        raise ValueError(f"unknown code {code!r}; expected one of {', '.join(CODES)}")
    storage = 4 if code == "e3m0" else _storage_bits(bits)
    return math.ceil(numel * storage / 8) + 4 * math.ceil(numel / chunk)


def _padded(values: torch.Tensor, length: int) -> torch.Tensor:
    """``values`` (flat) followed by zeros up to ``length`` elements."""
    return torch.cat([values, values.new_zeros(length - values.numel())]) if length > values.numel() else values


def _storage_bits(bits: int) -> int:
    """Bits a code occupies once packed: 2, 4 or 8 (3-bit codes take 4, 5-7-bit codes take 8)."""
    return 2 if bits <= 2 else 4 if bits <= 4 else 8
