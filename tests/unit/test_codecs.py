"""Low-bit codes for outer gradients: packing, round-trip error bounds, sizes."""

import pytest
import torch

from p2p_diloco import codecs


def _gradient(numel=5000, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # chunks of very different magnitudes, as pseudo-gradients of different layers have
    scale = torch.repeat_interleave(torch.tensor([1e-5, 1e-3, 0.2, 3.0, 1e-4]), numel // 5)
    return torch.randn(numel, generator=generator) * scale


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (1001,), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    packed = codecs.pack(codes, bits)
    assert packed.numel() == -(-1001 * bits // 8)
    assert torch.equal(codecs.unpack(packed, bits, 1001), codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_uniform_codes_stay_within_half_a_step_of_each_chunk(bits):
    x, chunk = _gradient(), 256
    packed, scales = codecs.quantize_uniform(x, bits, chunk)
    back = codecs.dequantize_uniform(packed, scales, bits, x.numel(), chunk)
    assert back.shape == x.shape and scales.numel() == -(-x.numel() // chunk)
    padded = torch.cat([x, torch.zeros(scales.numel() * chunk - x.numel())]).view(-1, chunk)
    bound = padded.abs().amax(dim=1) / ((1 << bits) - 2)  # = scale / 2
    error = torch.cat([(back - x), torch.zeros(scales.numel() * chunk - x.numel())]).abs().view(-1, chunk)
    assert bool((error <= bound[:, None] * (1 + 1e-5) + 1e-12).all())
    # the largest value of each chunk comes back exactly (up to fp32 rounding), with its sign
    top, rows = padded.abs().argmax(dim=1), torch.arange(padded.shape[0])
    back_rows = torch.cat([back, torch.zeros(scales.numel() * chunk - x.numel())]).view(-1, chunk)
    torch.testing.assert_close(back_rows[rows, top], padded[rows, top], rtol=1e-6, atol=0)


def test_e3m0_codes_keep_a_third_of_each_value_or_the_smallest_level():
    x, chunk = _gradient(seed=1), 512
    packed, scales = codecs.quantize_e3m0(x, chunk)
    assert packed.numel() == x.numel() // 2 == codecs.payload_bytes(x.numel(), "e3m0", chunk=chunk) - 4 * scales.numel()
    back = codecs.dequantize_e3m0(packed, scales, x.numel(), chunk)
    per_element_scale = torch.repeat_interleave(scales, chunk)[: x.numel()]
    bound = torch.maximum(x.abs() / 3, per_element_scale * 2.0**-7)
    assert bool(((back - x).abs() <= bound * (1 + 1e-5)).all())
    assert bool((torch.sign(back) * torch.sign(x) >= 0).all())  # never the wrong sign
    # levels are powers of two of the chunk's scale
    nonzero = back != 0
    ratio = (back.abs() / per_element_scale)[nonzero]
    assert torch.equal(torch.log2(ratio), torch.round(torch.log2(ratio)))
    assert float(torch.log2(ratio).min()) >= -6 and float(torch.log2(ratio).max()) <= 0


def test_zeros_and_short_tensors():
    for code in ("uniform", "e3m0"):
        x = torch.zeros(7)
        if code == "uniform":
            packed, scales = codecs.quantize_uniform(x, 4, chunk=4)
            back = codecs.dequantize_uniform(packed, scales, 4, 7, chunk=4)
        else:
            packed, scales = codecs.quantize_e3m0(x, chunk=4)
            back = codecs.dequantize_e3m0(packed, scales, 7, chunk=4)
        assert torch.equal(back, torch.zeros(7)) and torch.isfinite(scales).all()
    with pytest.raises(ValueError):
        codecs.quantize_uniform(torch.ones(3), 1)
    with pytest.raises(ValueError):
        codecs.quantize_e3m0(torch.ones(3), chunk=0)
    with pytest.raises(ValueError):
        codecs.payload_bytes(10, "int3")


def test_four_bit_payloads_are_about_eight_times_smaller_than_fp32():
    numel = 1_000_000
    fp32 = 4 * numel
    for code in ("uniform", "e3m0"):
        four = codecs.payload_bytes(numel, code, bits=4, chunk=1024)
        assert four == numel // 2 + 4 * 977
        assert 7.5 < fp32 / four < 8.0
    assert codecs.payload_bytes(numel, "uniform", bits=8) == numel + 4 * 977
    assert codecs.payload_bytes(numel, "uniform", bits=2) == numel // 4 + 4 * 977
