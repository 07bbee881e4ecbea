"""Weight caps and CenteredClip (p2p_diloco.algo.robust) against reference computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from p2p_diloco.algo import wire
from p2p_diloco.algo.robust import cap_weights, centered_clip, norm_halvings


def reference_centered_clip(x: np.ndarray, w: np.ndarray, factor: float, iterations: int) -> np.ndarray:
    """arXiv 2012.10333 eq. 3, written out in numpy with a plain loop per member."""
    w = w / w.sum()
    v = np.median(x, axis=0)
    tau = factor * np.median([np.linalg.norm(xi - v) for xi in x])
    for _ in range(iterations):
        move = np.zeros_like(v)
        for xi, wi in zip(x, w):
            z = xi - v
            n = np.linalg.norm(z)
            move += wi * z * (min(1.0, tau / n) if n > 0 else 1.0)
        v = v + move
    return v


def test_weight_caps_bound_one_claim_and_keep_honest_ratios():
    assert cap_weights([1.0, 1.0, 1.0, 1e9], 2.0) == [1.0, 1.0, 1.0, 2.0]
    assert cap_weights([1.0, 2.0, 1.5], 2.0) == [1.0, 2.0, 1.5]  # honest speeds differ: untouched
    # listeners (nothing to contribute) do not lower the median
    assert cap_weights([1e-12, 1e-12, 3.0, 5.0], 2.0, floor=1e-12) == [1e-12, 1e-12, 3.0, 5.0]
    assert cap_weights([0.0, 0.0], 2.0) == [0.0, 0.0]
    # the share bound of the docstring: 1 inflated member among K - 1 honest ones of equal weight
    for k in (2, 3, 4, 8):
        capped = cap_weights([1.0] * (k - 1) + [1e12], 2.0)
        assert capped[-1] / sum(capped) == pytest.approx(2.0 / (k + 1))
        capped = cap_weights([1.0] * (k - 1) + [1e12], 1.5)
        assert capped[-1] / sum(capped) == pytest.approx(1.5 / (1.5 + k - 1))
    # of a pair, the lower median: the mean of the two middle claims would be half the attacker's own
    assert cap_weights([1.0, 1e12], 1.5) == [1.0, 1.5]
    assert cap_weights([1.0, 9.0], 1.5) == [1.0, 1.5]
    with pytest.raises(ValueError, match="ratio"):
        cap_weights([1.0], 0.0)


def test_a_pair_round_is_halved_down_to_twice_the_shorter_update():
    rng = np.random.default_rng(1)
    honest = [torch.from_numpy(rng.normal(size=4000)) for _ in range(2)]
    shared = torch.from_numpy(rng.normal(size=4000))
    a, b = 0.6 * shared + 0.4 * honest[0], 2.0 * (0.6 * shared + 0.4 * honest[1])  # b twice as long (2x the steps)
    norms = [float(a.norm()), float(b.norm())]
    for weights in ([1.0, 1.0], [1.0, 1.5]):  # equal, and b's capped claim: untouched
        merged = (weights[0] * a + weights[1] * b) / sum(weights)
        assert norm_halvings(float(merged.norm()), norms) == 0
    # an attacker reversed at the bound (every element at +-1 against an update of RMS ~0.02), capped at 1.5x
    small = 0.02 * a / a.std()
    flipped = -torch.sign(small)
    merged = (small + 1.5 * flipped) / 2.5
    k = norm_halvings(float(merged.norm()), [float(small.norm()), float(flipped.norm())])
    assert 2 * float(small.norm()) / 2 < float(merged.norm()) * 2.0 ** -k <= 2 * float(small.norm())  # within (B/2, B]
    # lying about its norm does not help it: the shorter one counts
    assert norm_halvings(float(merged.norm()), [float(small.norm()), 1e9]) == k
    assert norm_halvings(2.0, [1.0, 5.0]) == 0 and norm_halvings(2.01, [1.0, 5.0]) == 1 and norm_halvings(8.5, [1.0, 5.0]) == 3
    assert norm_halvings(float("nan"), [1.0, 1.0]) is None and norm_halvings(1.0, [0.0, 1.0]) is None
    assert norm_halvings(1e-3, [1e-320, 1.0]) is None  # (a subnormal claim: no overflow, nothing applied)
    with pytest.raises(ValueError, match="2 or more"):
        norm_halvings(1.0, [1.0])


def test_two_colluding_attackers_of_four_are_cut_down_to_twice_an_honest_update():
    rng = np.random.default_rng(2)
    shared = torch.from_numpy(rng.normal(size=4000))
    honest = [0.02 * (0.6 * shared + 0.4 * torch.from_numpy(rng.normal(size=4000))) for _ in range(2)]
    flipped = -torch.sign(honest[0])  # both attackers send the same update, reversed at the bound
    points = torch.stack([*honest, flipped, flipped]).float()
    merged = centered_clip(points, torch.ones(4)).center  # half of the rows: no median tells them apart
    norms = [float(h.norm()) for h in honest] + [float(flipped.norm())] * 2
    k = norm_halvings(float(merged.norm()), norms)
    assert k >= 3 and float(merged.norm()) * 2.0 ** -k <= 2 * max(norms[:2])  # at most 2x the longer honest one
    # honest groups are left alone: a merge is no longer than its longest update
    three = torch.stack([honest[0], honest[1], 0.02 * shared]).float()
    assert norm_halvings(float(three.mean(0).norm()), [float(r.norm()) for r in three]) == 0


def test_centered_clip_matches_the_reference():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 300)).astype(np.float32)
    x[4] = -40.0 * x[:4].mean(0)  # one attacker, far out
    w = np.array([1.0, 2.0, 1.0, 1.5, 2.0])
    got = centered_clip(torch.from_numpy(x), torch.from_numpy(w), radius_factor=2.0, iterations=50, tolerance=0.0)
    want = reference_centered_clip(x.astype(np.float64), w, 2.0, 50)
    np.testing.assert_allclose(got.center.numpy(), want, rtol=1e-5, atol=1e-6)
    ratios = got.outlier_ratios()
    assert ratios[4] > 5 and bool((ratios[:4] < 2).all())
    # the attacker moved the result by at most its weight over the honest ones' times tau (the fixed
    # point's balance while no honest member is clipped), far less than it moved the mean
    honest = x[:4].astype(np.float64).T @ (w[:4] / w[:4].sum())
    mean = x.astype(np.float64).T @ (w / w.sum())
    shift = np.linalg.norm(got.center.numpy() - honest)
    assert shift <= w[4] / w[:4].sum() * got.radius * 1.01 + 1e-6
    assert shift < 0.2 * np.linalg.norm(mean - honest)


def test_edge_cases_two_members_all_equal_one_huge():
    two = torch.tensor([[1.0, 2.0], [3.0, -2.0]])
    result = centered_clip(two, torch.tensor([1.0, 3.0]))
    assert torch.allclose(result.center, torch.tensor([2.5, -1.0]))  # the weighted mean: no majority
    same = torch.full((4, 7), 0.25)
    result = centered_clip(same, torch.ones(4))
    assert result.radius == 0.0 and torch.equal(result.center, same[0])
    assert torch.equal(result.outlier_ratios(), torch.ones(4, dtype=torch.float64))
    # three agree exactly, one is huge: the answer is theirs, whatever its weight
    huge = torch.cat([torch.full((3, 5), 0.5), torch.full((1, 5), 1e30)])
    result = centered_clip(huge, torch.tensor([1.0, 1.0, 1.0, 1e6]))
    assert torch.equal(result.center, torch.full((5,), 0.5)) and math.isinf(float(result.outlier_ratios()[3]))
    with pytest.raises(ValueError, match="positive"):
        centered_clip(two, torch.zeros(2))
    with pytest.raises(ValueError, match=r"\[n, d\]"):
        centered_clip(two, torch.ones(3))


def test_the_result_stays_within_the_members_range_so_wire_averages_stay_exact():
    """Every element between the members' smallest and largest: on the exact-average encoding
    (C + Delta), y_i + (v - y_i) == v in fp32 for each member, so members end bit-identical."""
    rng = np.random.default_rng(1)
    max_delta = 0.5
    c = wire.wire_offset(max_delta)
    deltas = torch.from_numpy(rng.uniform(-max_delta, max_delta, size=(6, 4096)).astype(np.float32))
    deltas[5] = max_delta  # at the bound
    y = deltas + c
    result = centered_clip(y, torch.tensor([1.0, 1.0, 2.0, 1.0, 1.0, 50.0]))
    v = result.center
    assert bool((v >= y.min(0).values).all()) and bool((v <= y.max(0).values).all())
    for row in y:
        assert torch.equal(row + (v - row), v)


def test_a_reducer_leaves_out_listeners_and_far_outliers_and_bounds_the_rest():
    from p2p_diloco.net.reducer import MIN_WEIGHT, MergeRule, merge_points

    rng = np.random.default_rng(2)
    common = rng.normal(size=512)
    honest = [common + 0.5 * rng.normal(size=512) for _ in range(3)]
    attacker = -10.0 * np.sign(common)  # reversed, at a bound far beyond the honest updates
    listener = np.zeros(512)
    points = torch.tensor(np.stack([*honest, attacker, listener]), dtype=torch.float32)
    weights = torch.tensor([1.0, 1.0, 1.0, 1.5, MIN_WEIGHT], dtype=torch.float64)
    want = torch.tensor(np.mean(honest, axis=0), dtype=torch.float32)
    merged, ratios = merge_points(points, weights, MergeRule())
    assert ratios[4] is None and ratios[3] > 4 and all(r < 2 for r in ratios[:3])
    # the attacker is left out: CenteredClip of the honest three, close to their mean
    assert float((merged - want).norm()) < 0.05 * float(want.norm())
    assert bool((merged >= points[:4].min(0).values).all()) and bool((merged <= points[:4].max(0).values).all())
    mean, mean_ratios = merge_points(points, weights, MergeRule(aggregator="mean"))
    assert mean_ratios == ratios and float((mean - want).norm()) > 2 * float(want.norm())  # measured, not defended
    # two contributors and a listener: nothing tells them apart, the weighted mean of the two
    pair, pair_ratios = merge_points(points[[0, 3, 4]], weights[[0, 3, 4]], MergeRule())
    torch.testing.assert_close(pair, (points[0] + 1.5 * points[3]) / 2.5)
    assert pair_ratios == [None, None, None]


def test_reducer_agreement_singles_out_a_reducer_that_reversed_its_share():
    from p2p_diloco.algo.robust import disagreeing, reducer_agreement

    rng = np.random.default_rng(3)
    sent = [torch.tensor(rng.normal(size=(30, 10)), dtype=torch.float32)]
    others = torch.tensor(rng.normal(size=(30, 10)), dtype=torch.float32)
    merged = [(sent[0] + 2 * others) / 3]  # the mean of us and two others
    reducer_of = torch.arange(300, dtype=torch.int16) // 75  # 4 reducers, 75 elements each
    honest = reducer_agreement(merged, sent, reducer_of)
    assert sorted(honest) == [0, 1, 2, 3] and all(0.2 < c < 0.7 for c in honest.values())
    assert disagreeing(honest) == []
    merged[0].view(-1)[150:225] *= -1  # reducer 2 returned its share reversed
    agreement = reducer_agreement(merged, sent, reducer_of)
    assert agreement[2] < 0 and disagreeing(agreement) == [2]
    # too few reducers, or updates that do not agree at all: no signal
    assert disagreeing({0: 0.5, 1: -0.5}) == [] and disagreeing({0: 0.05, 1: 0.1, 2: -0.1}) == []
    unknown = torch.full((300,), -1, dtype=torch.int16)
    assert reducer_agreement(merged, sent, unknown) == {}


def test_a_share_against_the_outer_momentum_is_named_alike_by_every_member_on_the_base():
    from p2p_diloco.algo.robust import against_momentum, reducer_agreement

    rng = np.random.default_rng(5)
    momentum = [torch.tensor(rng.normal(size=(40, 10)), dtype=torch.float32)]
    # this round's mean update: along the momentum (cosine about 0.3), with noise of its own
    merged = [0.3 * momentum[0] + torch.tensor(rng.normal(size=(40, 10)), dtype=torch.float32)]
    reducer_of = torch.arange(400, dtype=torch.int16) // 100  # 4 reducers, 100 elements each
    honest = reducer_agreement(merged, momentum, reducer_of)
    assert all(c > 0.1 for c in honest.values()) and against_momentum(honest) == []
    merged[0].view(-1)[100:200] *= -1  # reducer 1 returned its share reversed
    assert against_momentum(reducer_agreement(merged, momentum, reducer_of)) == [1]
    # a fresh state (no momentum yet), or too few reducers: nothing is named
    assert reducer_agreement(merged, [torch.zeros_like(momentum[0])], reducer_of) == {}
    assert against_momentum({0: 0.3, 1: -0.3}) == [] and against_momentum({0: 0.01, 1: 0.02, 2: -0.5}) == []
    # a share a little against it while the others point along it is left as it is
    assert against_momentum({0: 0.3, 1: 0.25, 2: -0.1}) == []


def test_an_outlier_is_flagged_after_n_of_its_last_2n_minus_1_rounds_per_kind():
    from p2p_diloco.island.quarantine import Quarantine

    events = []
    q = Quarantine(island="me", probation=60.0, slot_spacing=4.0, check_lead=1.0, events=events.append,
                   outlier_rounds=3)
    for outlier in (True, False, True, False):  # 2 of 4: not yet
        assert q.note_outlier("x", outlier, now=0.0) == 0.0
        assert q.note_outlier("y", outlier, now=0.0, kind="reducer") == 0.0
    assert q.note_outlier("x", True, now=10.0) == 60.0  # 3 of the last 5
    assert q.flagged_reasons() == {"x": "outlier"} and events[-1]["reason"] == "outlier"
    assert q.note_outlier("x", True, now=11.0) == 0.0  # flagged already
    assert q.note_outlier("me", True, now=0.0) == 0.0  # never itself
    # old rounds slide out of the window of 5: T T F F F F T holds one
    for outlier in (True, True, False, False, False, False, True):
        assert q.note_outlier("z", outlier, now=0.0, kind="reducer") == 0.0
    assert q.note_outlier("y", True, now=0.0, kind="reducer") == 60.0  # T F T F T, kind by kind
    assert q.flagged_reasons() == {"x": "outlier", "y": "reducer"}
