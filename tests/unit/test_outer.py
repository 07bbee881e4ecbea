"""Outer-loop maths against references, with a fake all-reduce (no network)."""

import pytest
import torch

from p2p_diloco.algo import outer, wire


def _params(seed, shapes=((4, 3), (5,))):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def test_pseudo_gradient_sign_and_scale():
    theta_global = [torch.tensor([1.0, -2.0])]
    theta_local = [torch.tensor([0.8, -1.5])]  # local training moved the first down, the second up
    (delta,) = outer.pseudo_gradient(theta_global, theta_local)
    torch.testing.assert_close(delta, torch.tensor([0.2, -0.5]))  # Theta - theta: positive where it went down
    # one island, outer lr 1, no momentum: the outer step lands exactly on the local parameters
    params, buffers = [t.clone() for t in theta_global], [torch.zeros(2)]
    outer.outer_step(params, [delta], buffers, lr=1.0, momentum=0.0, nesterov=False)
    torch.testing.assert_close(params[0], theta_local[0])


def test_fake_allreduce_of_pseudo_gradients_is_fedavg():
    """Averaging M islands' pseudo-gradients then stepping with lr 1 gives the mean of their parameters."""
    theta_global = _params(0)
    locals_ = [_params(seed) for seed in (1, 2, 3)]
    deltas = [outer.pseudo_gradient(theta_global, theta) for theta in locals_]
    merged = outer.weighted_mean(deltas, [1.0, 1.0, 1.0])
    params, buffers = [t.clone() for t in theta_global], [torch.zeros_like(t) for t in theta_global]
    outer.outer_step(params, merged, buffers, lr=1.0, momentum=0.0, nesterov=False)
    for index, param in enumerate(params):
        torch.testing.assert_close(param, torch.stack([theta[index] for theta in locals_]).mean(0))
    # and a half-weight island pulls the result half as much
    merged = outer.weighted_mean(deltas[:2], [1.0, 0.5])
    expected = (deltas[0][0] * 1.0 + deltas[1][0] * 0.5) / 1.5
    torch.testing.assert_close(merged[0], expected)


def test_weighted_mean_rejects_zero_total_weight():
    with pytest.raises(ValueError):
        outer.weighted_mean([_params(1)], [0.0])


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_equals_torch_sgd(nesterov):
    start = _params(7)
    reference = [torch.nn.Parameter(t.clone()) for t in start]
    sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=nesterov)
    ours, buffers = [t.clone() for t in start], [torch.zeros_like(t) for t in start]
    for step in range(6):
        grads = _params(100 + step)
        for param, grad in zip(reference, grads):
            param.grad = grad.clone()
        sgd.step()
        outer.outer_step(ours, grads, buffers, lr=0.7, momentum=0.9, nesterov=nesterov)
        for mine, theirs in zip(ours, reference):
            torch.testing.assert_close(mine, theirs.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("nesterov", [True, False])
def test_groups_taking_turns_step_as_one_group_per_period(nesterov):
    """Delayed momentum (docs/DESIGN.md, "Groups that take turns"): G turns from one base with the
    groups' merged pseudo-gradients g_k land where one outer step on their mean lands (the one-group
    step, which is torch's SGD: above), period after period."""
    start = _params(7)
    one, one_m = [t.clone() for t in start], [torch.zeros_like(t) for t in start]
    turns, turns_m = [t.clone() for t in start], [torch.zeros_like(t) for t in start]
    for period in range(5):
        grads = [_params(100 + 4 * period + k) for k in range(4)]
        mean = [torch.stack(parts).mean(0) for parts in zip(*grads)]
        outer.outer_step(one, mean, one_m, lr=0.7, momentum=0.9, nesterov=nesterov)
        for k, g in enumerate(grads):
            outer.turn_step(turns, g, turns_m, lr=0.7, momentum=0.9, nesterov=nesterov, turn=k, turns=4)
        for mine, theirs in zip(turns + turns_m, one + one_m):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="turn 4 is outside"):
        outer.turn_step(turns, grads[0], turns_m, lr=0.7, momentum=0.9, nesterov=nesterov, turn=4, turns=4)


def test_token_weight_is_tokens_squared_over_steps():
    assert outer.token_weight(1000, 10) == pytest.approx(1e5)
    assert outer.token_weight(0, 0) == 0.0 and outer.token_weight(500, 0) == 0.0
    # twice the tokens in the same steps (bigger batches) weighs 4x; same tokens in twice the steps, half
    assert outer.token_weight(2000, 10) == pytest.approx(4 * outer.token_weight(1000, 10))
    assert outer.token_weight(1000, 20) == pytest.approx(outer.token_weight(1000, 10) / 2)


def test_apply_mix_alpha():
    local, new_global = [torch.tensor([2.0, 4.0])], [torch.tensor([0.0, 0.0])]
    mixed = [local[0].clone()]
    outer.apply_mix(mixed, new_global, alpha=0.5)
    assert torch.equal(mixed[0], torch.tensor([1.0, 2.0]))
    replaced = [local[0].clone()]
    outer.apply_mix(replaced, new_global, alpha=0.0)
    assert torch.equal(replaced[0], new_global[0])
    kept = [local[0].clone()]
    outer.apply_mix(kept, new_global, alpha=1.0)
    assert torch.equal(kept[0], local[0])


def test_carry_keeps_progress_made_during_the_round():
    snapshot = [torch.tensor([1.0, 1.0])]
    now = [torch.tensor([0.9, 1.2])]  # inner steps taken after the snapshot
    new_global = [torch.tensor([0.5, 0.5])]
    outer.apply_carry(now, outer.carry_correction(new_global, snapshot))
    torch.testing.assert_close(now[0], torch.tensor([0.4, 0.7]))


def _hivemind_reduce(ys, weights):
    """What hivemind's TensorPartReducer computes: accumulate w*y in fp32, divide by the total weight."""
    accumulator = torch.zeros_like(ys[0])
    denominator = 0.0
    for y, w in zip(ys, weights):
        accumulator.add_(y, alpha=w)
        denominator += w
    return accumulator.div_(denominator)


def test_wire_encoding_makes_every_member_receive_the_same_bits():
    offset = wire.wire_offset(1.0)
    assert offset == 4.0
    generator = torch.Generator().manual_seed(3)
    deltas = [[torch.randn(1000, generator=generator) * scale] for scale in (1e-4, 3e-2, 0.4)]
    deltas[2][0][:5] = 7.0  # beyond max_delta: clipped
    expected_clipped = sum(int((d[0].abs() > 1.0).sum()) for d in deltas)
    assert expected_clipped >= 5
    wires, clipped = [], 0
    for delta in deltas:
        buffer = [torch.empty(1000)]
        clipped += wire.clip_(delta, 1.0)
        wire.encode_for_wire(delta, buffer, offset)
        wires.append(buffer[0])
    assert clipped == expected_clipped
    avg = _hivemind_reduce(wires, [3.5, 1.0, 120.25])
    received = [y + (avg - y) for y in wires]  # each member adds the reducer's delta to its own tensor
    for tensor in received:
        assert torch.equal(tensor, avg)
    merged = wire.decode_from_wire([avg], offset)[0]
    reference = outer.weighted_mean(deltas, [3.5, 1.0, 120.25])[0]  # deltas were clipped in place
    torch.testing.assert_close(merged, reference, rtol=0, atol=4 * offset * 2**-24)


def test_parts_of_a_failed_reducer_are_zeroed_alike_on_every_member():
    """hivemind leaves each member its own values for the part a failed reducer owned; with the
    parts find_unaveraged finds set to zero, every member holds the same merged pseudo-gradient, averaged where a reducer
    answered and zero in the failed part."""
    offset, weights = wire.wire_offset(1.0), [1.0, 2.0, 0.5]
    generator = torch.Generator().manual_seed(5)
    shapes = [(60, 50), (1000,), (7,)]  # 4007 elements, flattened in this order as hivemind does
    deltas = [[torch.randn(shape, generator=generator) * 1e-3 for shape in shapes] for _ in weights]
    for delta in deltas:
        delta[0][20:40] = 0.25  # every member sent the same values here (an all-equal region)
    wires = [[torch.empty(shape) for shape in shapes] for _ in weights]
    for delta, buffers in zip(deltas, wires):
        wire.encode_for_wire(delta, buffers, offset)
    flat = [torch.cat([t.reshape(-1) for t in buffers]) for buffers in wires]
    avg = _hivemind_reduce([f.clone() for f in flat], weights)
    failed = slice(1200, 3300)  # the failed reducer's part crosses a tensor boundary
    merged_by_member = []
    for own in flat:
        received = own + (avg - own)
        received[failed] = own[failed]  # hivemind: register_failed_reducer keeps the local part
        pieces, position = [], 0
        for shape in shapes:
            n = torch.Size(shape).numel()
            pieces.append(received[position:position + n].view(shape).clone())
            position += n
        merged_by_member.append(wire.decode_from_wire(pieces, offset))
    zeroed = []
    for merged, delta in zip(merged_by_member, deltas):
        masks = wire.find_unaveraged(merged, wire.wire_roundtrip(delta, offset))
        for tensor, mask in zip(merged, masks):
            tensor.masked_fill_(mask, 0.0)
        zeroed.append(sum(int(mask.sum()) for mask in masks))
    first = merged_by_member[0]
    for merged in merged_by_member[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, merged))  # bitwise identical on every member
    flat_merged = torch.cat([t.reshape(-1) for t in first])
    assert torch.equal(flat_merged[failed], torch.zeros(2100))
    assert not torch.signbit(flat_merged[failed]).any()  # +0.0 everywhere: same bits, same hash
    reference = torch.cat([t.reshape(-1) for t in outer.weighted_mean(deltas, weights)])
    kept = torch.ones(4007, dtype=torch.bool)
    kept[failed] = False
    kept[1000:2000] = False  # the all-equal region (rows 20..39 of the first tensor) is zeroed alike too
    torch.testing.assert_close(flat_merged[kept], reference[kept], rtol=0, atol=4 * offset * 2**-24)
    assert zeroed == [zeroed[0]] * 3 and 2100 <= zeroed[0] <= 2100 + 1000
    # a round where every reducer answered changes nothing, and neither do short coincidences
    merged = wire.decode_from_wire([avg.clone()], offset)
    sent = [torch.cat([t.reshape(-1) for t in deltas[0]])]
    sent[0][1000:2000] = 0.3  # no longer all-equal: this member's values differ from the average
    merged[0][:10] = sent[0][:10]  # 10 elements that happen to equal the average
    assert wire.find_unaveraged(merged, sent) is None


def test_only_bases_two_islands_hold_are_vouched_for_once_two_report():
    assert outer.vouched([(3, "a")]) == [(3, "a")]  # the only island's word
    assert outer.vouched([(3, "a"), (9, "x")]) == []  # two disagree: nobody decides alone
    assert outer.vouched([(3, "a"), (9, "x"), (3, "a")]) == [(3, "a"), (3, "a")]  # one entry per holder
    assert outer.vouched([]) == []


def test_canonical_base():
    assert outer.canonical_base([(3, "b"), (4, "z"), (3, "a")]) == (4, "z")  # newest version wins
    assert outer.canonical_base([(4, "z"), (4, "a"), (4, "z")]) == (4, "z")  # then the majority
    assert outer.canonical_base([(4, "z"), (4, "a")]) == (4, "a")  # then the smaller hash
    assert outer.canonical_base([(4, "a"), (4, "z")]) == (4, "a")  # independent of order
    # in a group of 3 or more, a base that only one member holds cannot outrank a shared one: a
    # member claiming a far newer version does not make the others drop theirs
    assert outer.canonical_base([(3, "a"), (1000, "x"), (3, "a")]) == (3, "a")
    assert outer.canonical_base([(3, "a"), (1000, "x")]) == (1000, "x")  # 2 members: no majority
    # two clients behind NAT that joined at version 2 and a public island that moved on alone: the
    # clients' shared base would be a result that nobody can download from them; the public one wins
    assert outer.canonical_base([(2, "c"), (2, "c"), (3, "p")], serving=[False, False, True]) == (3, "p")
    # ... but a base a serving member shares with them keeps the rule: no lone newer claim wins
    assert outer.canonical_base([(2, "c"), (2, "c"), (9, "x")], serving=[True, False, True]) == (2, "c")
    assert outer.canonical_base([(4, "z"), (4, "a")], serving=[True, False]) == (4, "z")  # a pair too
    assert outer.canonical_base([(4, "z"), (4, "a")], serving=[True, True]) == (4, "a")  # (as without)
    with pytest.raises(ValueError):
        outer.canonical_base([(4, "z")], serving=[True, False])
    with pytest.raises(ValueError):
        outer.canonical_base([])
    with pytest.raises(ValueError):
        wire.wire_offset(0.0)


def test_tensors_hash():
    a = _params(1)
    assert outer.tensors_hash(a) == outer.tensors_hash([t.clone() for t in a])
    b = [t.clone() for t in a]
    b[1][0] = torch.nextafter(b[1][0], torch.tensor(10.0))  # one ulp
    assert outer.tensors_hash(a) != outer.tensors_hash(b)
    assert outer.tensors_hash([torch.zeros(2, 3)]) != outer.tensors_hash([torch.zeros(3, 2)])


def test_all_finite():
    assert outer.all_finite(_params(1))
    assert not outer.all_finite([torch.tensor([1.0, float("nan")])])
    assert not outer.all_finite([torch.tensor([float("inf")])])


def test_rda_keeps_the_mean_direction_at_the_mean_norm():
    generator = torch.Generator().manual_seed(11)
    deltas = [[torch.randn(6, 5, generator=generator) * scale, torch.randn(7, generator=generator)] for scale in (0.1, 2.0, 0.5)]
    weights = [1.0, 3.0, 0.5]
    merged = outer.rda_mean(deltas, weights)
    for j in range(2):
        units = [d[j] / d[j].norm() for d in deltas]
        ubar = sum(w * u for w, u in zip(weights, units)) / sum(weights)
        nbar = sum(w * d[j].norm() for w, d in zip(weights, deltas)) / sum(weights)
        torch.testing.assert_close(merged[j].norm(), nbar, rtol=1e-5, atol=0)  # the weighted mean of norms
        torch.testing.assert_close(merged[j] / merged[j].norm(), ubar / ubar.norm(), rtol=1e-5, atol=1e-6)
    # unlike the plain mean, a large update does not drown the direction of the others
    plain = outer.weighted_mean(deltas, weights)
    assert merged[0].norm() > plain[0].norm()


def test_rda_edge_cases_one_contributor_cancelling_directions_zero_weight():
    delta = _params(4)
    for got, want in zip(outer.rda_mean([delta], [2.5]), delta):  # one contributor: its own Delta
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    opposite = [[t * 2.0 for t in delta], [t * -2.0 for t in delta]]  # equal weights: directions cancel
    merged = outer.rda_mean(opposite, [1.0, 1.0])
    for got, want in zip(merged, outer.weighted_mean(opposite, [1.0, 1.0])):  # falls back to the mean (zero)
        torch.testing.assert_close(got, want)
        assert torch.isfinite(got).all()
    unequal = [[t * 3.0 for t in delta], [t * -1.0 for t in delta]]  # cancelling directions, unequal norms
    for got in outer.rda_mean(unequal, [1.0, 1.0]):  # nbar * ubar: no direction to keep, no blow-up
        assert torch.isfinite(got).all() and float(got.abs().max()) < 1e-5
    zeros = [[torch.zeros(3, 2)], [torch.zeros(3, 2)]]
    assert torch.equal(outer.rda_mean(zeros, [1.0, 1.0])[0], torch.zeros(3, 2))  # all zero: zero, no NaN
    assert torch.equal(outer.rda_mean([delta, delta], [0.0, 0.0])[0], torch.zeros_like(delta[0]))  # zero weight
    units, norms = outer.unit_directions([torch.zeros(4), torch.tensor([3.0, 4.0])])
    assert torch.equal(units[0], torch.zeros(4)) and norms == [0.0, 5.0]
    torch.testing.assert_close(units[1], torch.tensor([0.6, 0.8]))


def test_merge_result_rescales_rda_tensors_to_the_mean_norm_and_leaves_mean_tensors():
    generator = torch.Generator().manual_seed(5)
    deltas = [[torch.randn(4, 3, generator=generator) * s, torch.randn(5, generator=generator) * s] for s in (0.2, 1.0)]
    weights = [1.0, 3.0]
    rda = [True, False]
    sent = [outer.wire_values(d, rda) for d in deltas]
    assert sent[0][1][1] == 0.0 and sent[0][1][0] == pytest.approx(float(deltas[0][0].norm()))
    averaged = outer.weighted_mean([values for values, _ in sent], weights)
    merged = outer.merge_result(averaged, rda, [norms for _, norms in sent], weights)
    reference = outer.rda_mean(deltas, weights)
    torch.testing.assert_close(merged[0], reference[0], rtol=1e-5, atol=1e-6)  # RDA tensor
    torch.testing.assert_close(merged[1], outer.weighted_mean(deltas, weights)[1])  # mean tensor untouched
    assert outer.merge_result(averaged, [False, False], [], weights) == averaged  # no RDA: as averaged
    assert outer.mean_norms([[1.0, 2.0], [3.0, 4.0]], [1.0, 1.0]) == [2.0, 3.0]
    assert outer.mean_norms([[1.0], [3.0]], [0.0, 0.0]) == [0.0]  # zero weight: no division


def test_per_tensor_offsets_and_bounds():
    values = [torch.tensor([0.5, -0.25]), torch.tensor([0.75])]
    out = [torch.empty(2), torch.empty(1)]
    wire.encode_for_wire(values, out, [4.0, 8.0])
    assert out[0].tolist() == [4.5, 3.75] and out[1].tolist() == [8.75]
    assert [t.tolist() for t in wire.decode_from_wire(out, [4.0, 8.0])] == [[0.5, -0.25], [0.75]]
    assert wire.max_abs_sent(out, [4.0, 8.0]) == 0.75
    assert wire.within_bound(values, [0.5, 1.0]) and not wire.within_bound(values, [0.4, 1.0])
    with pytest.raises(ValueError, match="2 values for 1 tensors"):
        wire.encode_for_wire(values[:1], out[:1], [1.0, 2.0])
