"""Low-bit grids, the lossless wire codecs and their byte counters (no network)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from p2p_diloco.algo import grid as wire
from p2p_diloco.net import codec as wire_codec


def _hivemind_average(values: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """What hivemind's TensorPartReducer computes: fp32 accumulate with alpha=weight, then divide."""
    acc = torch.zeros_like(values[0])
    for value, weight in zip(values, weights):
        acc.add_(value, alpha=weight)
    return acc.div_(sum(weights))


@pytest.mark.parametrize("codec", list(wire.LEVELS))
def test_quantization_error_is_at_most_half_a_step_and_steps_fit_the_largest_value(codec):
    levels = wire.LEVELS[codec]
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5000, generator=generator) * torch.logspace(-6, 0, 5000)  # chunks of very different sizes
    exponents = wire.chunk_exponents(x, levels)
    q = wire.quantize(x, exponents, levels)
    step = torch.exp2(exponents.to(torch.float64)).repeat_interleave(wire.CHUNK)[:5000]
    chunk_max = x.abs().reshape(-1)[:4096].view(-1, wire.CHUNK).amax(1)
    assert (levels * step[:4096].view(-1, wire.CHUNK)[:, 0] >= chunk_max.double()).all()  # no clipping
    assert (levels * step[:4096].view(-1, wire.CHUNK)[:, 0] < 2 * chunk_max.double()).all()  # the smallest such step
    assert ((q.double() - x.double()).abs() <= step / 2).all()
    assert torch.equal(wire.quantize(q, exponents, levels), q)  # grid values stay put


def test_exponents_of_zero_nonfinite_and_exact_powers_of_two():
    x = torch.zeros(3 * wire.CHUNK)
    x[wire.CHUNK] = 7.0 * 2.0**-10  # exactly L * 2^-10 for int4: e = -10, not -9
    x[2 * wire.CHUNK] = float("nan")
    assert wire.chunk_exponents(x, 7).tolist() == [wire.EMPTY_EXPONENT, -10, wire.TOP_EXPONENT]
    assert wire.chunk_exponents(torch.tensor([7.0 * 2.0**-10 * 1.0000001]), 7).tolist() == [-9]


def test_shared_exponents_take_the_largest_and_ignore_malformed_reports():
    shapes = [torch.Size([3, 700]), torch.Size([5])]  # 3 chunks, then 1
    a = wire.exponents_report([torch.full((3, 700), 1e-3), torch.full((5,), 1.0)], 7)
    b = wire.exponents_report([torch.full((3, 700), 1e-1), torch.zeros(5)], 7)
    shared = wire.shared_exponents([a, b, b"junk", None, 3], shapes)
    assert [t.tolist() for t in shared] == [wire.chunk_exponents(torch.full((3, 700), 1e-1), 7).tolist(),
                                            wire.chunk_exponents(torch.ones(5), 7).tolist()]
    assert all((t == wire.TOP_EXPONENT).all() for t in wire.shared_exponents([b"junk"], shapes))


@pytest.mark.parametrize("codec", list(wire.LEVELS))
def test_members_end_with_identical_bits_through_the_codec(codec):
    """Members' values on the shared grid, averaged as hivemind does and sent back as replies through
    the codec: every member ends with the reducer's average, bit for bit, close to the exact mean."""
    levels = wire.LEVELS[codec]
    generator = torch.Generator().manual_seed(2)
    shapes = [torch.Size([40, 70]), torch.Size([300])]
    deltas = [[torch.randn(s, generator=generator) * 1e-3 for s in shapes] for _ in range(3)]
    weights = [0.3, 1.7, 1e-12]  # the last is a listener
    reports = [wire.exponents_report(d, levels) for d in deltas]
    buffers = [[t.clone() for t in d] for d in deltas]
    for buffer in buffers:
        wire.put_on_grid_(buffer, reports, levels)
    codec_obj = wire_codec.make_codec(codec, torch.zeros(2, dtype=torch.int64))
    flat = [torch.cat([t.reshape(-1) for t in b]) for b in buffers]
    received = [codec_obj.extract(codec_obj.compress(f)) for f in flat]
    assert all(torch.equal(r, f) for r, f in zip(received, flat))  # lossless uplink
    average = _hivemind_average(received, weights)
    results = [f + codec_obj.extract(codec_obj.compress(average - f)) for f in flat]
    assert all(torch.equal(r, average) for r in results)
    grid = wire.shared_exponents(reports, shapes)
    merged = [wire.from_wire(t.view(s), e) for t, s, e in zip(torch.split(average, [s.numel() for s in shapes]), shapes, grid)]
    for j, (tensor, exponents) in enumerate(zip(merged, grid)):
        step = torch.exp2(exponents.double()).repeat_interleave(wire.CHUNK)[:tensor.numel()].view_as(tensor)
        quantized = [wire.quantize(d[j], exponents, levels) for d in deltas]
        exact = sum(w * q.double() for w, q in zip(weights, quantized)) / sum(weights)
        # the weighted mean on the grid, up to the reducer's fp32 accumulation (a step per addition)
        assert ((tensor.double() - exact).abs() <= (len(weights) + 1) * step).all()


def test_int4_messages_are_over_six_times_smaller_than_fp32():
    generator = torch.Generator().manual_seed(3)
    deltas = [[torch.randn(100_000, generator=generator) * 1e-3] for _ in range(2)]
    reports = [wire.exponents_report(d, 7) for d in deltas]
    for d in deltas:
        wire.put_on_grid_(d, reports, 7)
    grid, raw = wire_codec.make_codec("int4"), wire_codec.make_codec("none")
    average = _hivemind_average([d[0] for d in deltas], [1.0, 2.0])
    up = len(grid.compress(deltas[0][0]).buffer)
    down = len(grid.compress(average - deltas[0][0]).buffer)
    assert up <= 100_000 * 4 / 8 * 1.02  # 4 bits per value, headers included
    assert down <= 100_000 * (5 + wire.GUARD_BITS) / 8 * 1.02  # at most 5 + GUARD_BITS bits per value
    plain = len(raw.compress(deltas[0][0]).buffer) + len(raw.compress(average - deltas[0][0]).buffer)
    assert plain / (up + down) >= 6.5


@pytest.mark.parametrize("values", [
    np.array([], dtype=np.float32),
    np.array([0.0, -0.0, 1.0, -3.5, 1e-40, 3e38], dtype=np.float32),  # signs, zero, subnormal, huge
    np.random.default_rng(0).standard_normal(3000).astype(np.float32),  # no grid at all
    np.array([1.0, float("nan"), float("inf")], dtype=np.float32),
    (1.5 * 2.0**10 + np.arange(-7, 8, dtype=np.float32) * 2.0**-13),  # one binade's grid
])
def test_the_grid_format_is_lossless_for_any_fp32(values):
    decoded = wire.decode(wire.encode_grid(values))
    assert decoded.dtype == np.float32 and decoded.shape == values.reshape(-1).shape
    assert np.array_equal(decoded.view(np.uint32), values.astype(np.float32).reshape(-1).view(np.uint32))


def test_bit_packing_round_trip_for_every_width():
    rng = np.random.default_rng(4)
    for width in range(1, 40):
        codes = rng.integers(0, 2**width, size=777, dtype=np.int64)
        packed = wire.pack_bits(codes, width)
        assert len(packed) == -(-777 * width // 8)
        assert np.array_equal(wire.unpack_bits(packed, width, 777), codes)


def test_codecs_count_the_bytes_of_each_message_they_send_and_receive():
    counters = torch.zeros(2, dtype=torch.int64)
    codec = wire_codec.make_codec("int8", counters)
    tensor = wire.quantize(torch.linspace(-1, 1, 4096), wire.chunk_exponents(torch.linspace(-1, 1, 4096), 127), 127)
    message = codec.compress(tensor)
    assert counters.tolist() == [message.ByteSize(), 0]
    codec.extract(message)
    codec.extract(message)
    assert counters.tolist() == [message.ByteSize(), 2 * message.ByteSize()]
    assert message.ByteSize() < 4096 * 9 / 8 + 200  # 8 bits per value (one binade) plus framing


def test_codec_names_and_estimates():
    assert wire.levels_of("none") == 0 and wire.levels_of("int4") == 7
    with pytest.raises(ValueError, match="unknown codec 'int3'"):
        wire.levels_of("int3")
    assert wire_codec.make_codec("int4").estimate_compression_ratio(None) == pytest.approx(4 / 32)
    assert wire_codec.make_codec("none").estimate_compression_ratio(None) == 1.0


def test_install_makes_hivemind_decode_our_messages():
    from hivemind.compression import deserialize_torch_tensor, serialization, serialize_torch_tensor

    codec = wire_codec.make_codec("int4")
    before = dict(serialization._BASE_COMPRESSION_TYPES)
    try:
        wire_codec.install(codec)
        tensor = 1.5 * 2.0**10 + torch.arange(-7, 8, dtype=torch.float32) * 2.0**-13
        message = serialize_torch_tensor(tensor, codec.compression_type)  # the reducer's reply path
        assert len(message.buffer) < 1 + 4 * 15  # smaller than raw fp32, even with its header
        assert torch.equal(deserialize_torch_tensor(message), tensor)
    finally:
        serialization._BASE_COMPRESSION_TYPES.clear()
        serialization._BASE_COMPRESSION_TYPES.update(before)


def test_a_short_message_cannot_claim_more_values_than_its_tensor():
    import struct

    bomb = struct.pack("<BBBII", 1, 8, 0, 1 << 31, 1) + b"\x00" * 6  # claims 2^31 one-byte codes
    with pytest.raises(ValueError, match="malformed"):
        wire.decode(bomb, expected=4)
    with pytest.raises(ValueError, match="malformed"):
        wire.decode(bomb)  # even without the tensor's size: the payload is far too short
    good = wire.encode_grid(np.full(10, 1.5, dtype=np.float32))
    with pytest.raises(ValueError):
        wire.decode(good, expected=11)
    codec = wire_codec.make_codec("int4")
    message = codec.compress(torch.full((10,), 1.5))
    message.size[:] = [1 << 20, 1 << 20]
    with pytest.raises(ValueError, match="larger than any fragment part"):
        codec.extract(message)


def test_grid_ceilings_and_range_checks():
    reports = [wire.exponents_report([torch.full((10,), 1e30)], 7)]  # a member claiming a huge step
    (capped,) = wire.shared_exponents(reports, [torch.Size([10])], ceilings=[wire.ceiling_exponent(1.0, 7)])
    assert capped.tolist() == [wire.ceiling_exponent(1.0, 7)]
    exponents = torch.tensor([-3], dtype=torch.int16)
    assert wire.within_grid(torch.full((4,), 8 * 2.0**-3), exponents, 7)  # L + 1 steps: rounding room
    assert not wire.within_grid(torch.full((4,), 9 * 2.0**-3), exponents, 7)
    assert not wire.within_grid(torch.tensor([float("nan")]), exponents, 7)


def test_the_failure_recorder_marks_exactly_the_parts_of_a_failed_reducer():
    from concurrent.futures import Future
    from types import SimpleNamespace

    from hivemind.averaging.partition import TensorPartContainer

    from p2p_diloco.net.averager import _FailureRecorder

    tensors = [torch.zeros(30), torch.zeros(7, 5)]  # 65 elements, parts of 8 values
    container = TensorPartContainer(tensors, peer_fractions=(0.5, 0.3, 0.2), part_size_bytes=32)
    mask = torch.ones(65, dtype=torch.uint8)
    recorder = _FailureRecorder(mask)
    assert int(mask.sum()) == 0
    future = Future()
    future.set_result(SimpleNamespace(tensor_part_container=container))
    recorder.attach(future)
    assert recorder.count() == 0
    container.register_failed_reducer(1)
    expected = torch.zeros(65, dtype=torch.uint8)
    position = 0
    for peer, parts in enumerate(container._input_parts_by_peer):
        for part, _ in parts:
            if peer == 1:
                expected[position:position + part.numel()] = 1
            position += part.numel()
    assert torch.equal(mask, expected) and recorder.count() == int(expected.sum()) > 0
    partition_log = logging.getLogger("hivemind.averaging.partition")
    level = partition_log.level
    partition_log.setLevel(logging.ERROR)  # finalizing a half-done container warns about the missing parts
    try:
        container.finalize()
    finally:
        partition_log.setLevel(level)
