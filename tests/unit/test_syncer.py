"""The syncer's round logic with a fake all-reduce that computes what hivemind's does (no network)."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest
import torch

from p2p_diloco import outer, wire
from p2p_diloco.config import OuterConfig
from p2p_diloco.fragments import FragmentLayout
from p2p_diloco.schedule import RoundSlot
from p2p_diloco.syncer import WEIGHT_UNIT, FragmentState, Snapshot, Syncer

SHAPES = [[torch.Size([3, 2]), torch.Size([4])]]
LAYOUT = FragmentLayout(fragments=(("w", "b"),), sizes=(10,))
CONFIG = OuterConfig(period=10.0, fragments=1, matchmaking_time=1.0, grace_window=0.2, allreduce_timeout=1.0,
                     request_timeout=0.2)


class FakeControl:
    def __init__(self, group):
        self.group = group

    def result(self, timeout=None):
        self.group.done.wait(timeout)
        if not self.group.done.is_set():
            from concurrent.futures import TimeoutError

            raise TimeoutError()
        if self.group.fail:
            raise RuntimeError("could not find a group")
        return self.group.gathered

    def done(self):
        return self.group.done.is_set()

    def cancel(self):
        return True


class FakeGroup:
    """All members call step(); once ``size`` arrived, each gets y_i + (avg - y_i) like hivemind."""

    def __init__(self, size: int, fail: bool = False, failed_tensor: int = -1):
        self.size, self.fail, self.failed_tensor = size, fail, failed_tensor
        self.arrived: list = []
        self.gathered: dict = {}
        self.done = threading.Event()
        self.lock = threading.Lock()

    def step(self, averager, gather, weight):
        with self.lock:
            self.arrived.append((averager, gather, weight))
            if len(self.arrived) == self.size:
                self._reduce()
        return FakeControl(self)

    def _reduce(self):
        if not self.fail:
            weights = [w for _, _, w in self.arrived]
            reports = [gather.get("exponents") for _, gather, _ in self.arrived]
            for averager, _, _ in self.arrived:  # what each member's averager does once the group is known
                syncer = averager.syncer
                if syncer.levels:
                    grid = wire.put_on_grid_(averager.buffers, reports, syncer.levels, syncer.ceilings[0])
                    syncer.shared[0]["grid"].copy_(grid)
            # every message goes through the codecs (counting bytes), a member's to its neighbour
            codecs = [wire.make_codec(a.syncer.config.codec, a.syncer.traffic[0]) for a, _, _ in self.arrived]
            for index in range(len(self.arrived[0][0].buffers)):
                acc = torch.zeros_like(self.arrived[0][0].buffers[index])
                for i, (averager, _, w) in enumerate(self.arrived):
                    neighbour = codecs[(i + 1) % len(codecs)]
                    acc.add_(neighbour.extract(codecs[i].compress(averager.buffers[index])), alpha=w)
                avg = acc.div_(sum(weights))
                for i, (averager, _, _) in enumerate(self.arrived):
                    buffer = averager.buffers[index]
                    if index != self.failed_tensor:  # hivemind: a failed reducer's part stays as sent
                        neighbour = codecs[(i + 1) % len(codecs)]
                        buffer.add_(codecs[i].extract(neighbour.compress(avg - buffer)))
            for averager, _, _ in self.arrived:  # what the averager reports: elements of failed reducers
                mask = averager.syncer.shared[0]["failed_mask"]
                mask.zero_()
                if self.failed_tensor >= 0:
                    start = sum(b.numel() for b in averager.buffers[:self.failed_tensor])
                    mask[start:start + averager.buffers[self.failed_tensor].numel()] = 1
                averager.syncer.traffic[0, 2] = int(mask.sum())
            self.gathered = {f"peer{i}": gather for i, (_, gather, _) in enumerate(self.arrived)}
        self.done.set()


class FakeAverager:
    def __init__(self, syncer: Syncer, group: FakeGroup, donor: Syncer | None = None):
        self.syncer, self.group, self.donor = syncer, group, donor
        self.buffers = syncer.buffers[0]
        self.state_sharing_priority = 0.0
        self.allow_state_sharing = False
        self.group_bits = ""

    def set_group_bits(self, bits, wait=True):
        self.group_bits = bits

    def is_alive(self):
        return True

    @contextlib.contextmanager
    def get_tensors(self):
        yield self.buffers

    tamper = None  # a test may rewrite this member's gathered metadata (a lying member)

    def step(self, *, gather, weight, **_):
        if self.tamper is not None:
            gather = self.tamper(dict(gather))
        return self.group.step(self, gather, weight)

    def load_state_from_peers(self, wait=True, timeout=None):
        return None if self.donor is None else self.donor._donate(0)


class FakeLearner:
    def __init__(self, params):
        self.params, self.updates, self.step_time = params, [], 0.0

    def request_snapshot(self, fragment, timeout):
        return Snapshot(fragment, [p.clone() for p in self.params], tokens=4096, steps=2)

    def deliver(self, update):
        self.updates.append(update)


def _syncer(name, theta, local, bases=lambda: [], corrupt="", config=CONFIG, layout=LAYOUT, shapes=SHAPES):
    learner = FakeLearner(local)
    events: list[dict] = []
    syncer = Syncer(run_id="r", fingerprint="f" * 16, island=name, config=config, layout=layout, shapes=shapes,
                    learner=learner, events=events.append, swarm_bases=bases, corrupt=corrupt)
    syncer.initialize([theta])
    return syncer, learner, events


def _params(seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * scale for shape in SHAPES[0]]


def _round(*syncers):
    slot = RoundSlot(time.time() + 0.1, 0, 7)
    threads = [threading.Thread(target=s._run_round, args=(0, slot)) for s in syncers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)


def test_members_with_the_same_base_end_identical_at_the_nesterov_step_of_the_mean():
    theta = _params(0)
    local_a, local_b = [t - 0.01 * g for t, g in zip(theta, _params(1))], [t - 0.02 * g for t, g in zip(theta, _params(2))]
    a, _, events_a = _syncer("a", theta, local_a)
    b, _, events_b = _syncer("b", theta, local_b)
    group = FakeGroup(2)
    a.averagers, b.averagers = [FakeAverager(a, group)], [FakeAverager(b, group)]
    _round(a, b)
    assert events_a[-1]["outcome"] == events_b[-1]["outcome"] == "ok"
    assert a.states[0].hash == b.states[0].hash and a.versions == b.versions == [1]
    merged = outer.weighted_mean([outer.pseudo_gradient(theta, local_a), outer.pseudo_gradient(theta, local_b)],
                                 [1.0, 1.0])  # equal tokens and steps: equal weights
    expected = [t.clone() for t in theta]
    outer.outer_step(expected, merged, [torch.zeros_like(t) for t in theta], lr=0.7, momentum=0.9, nesterov=True)
    for got, want in zip(a.states[0].theta, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert events_a[-1]["weight"] == outer.token_weight(4096, 2) / WEIGHT_UNIT
    assert a.stats.rounds_ok == 1 and a.stats.bytes_sent > 0


def test_a_part_no_reducer_averaged_gets_no_outer_update_and_keeps_the_local_progress():
    theta = _params(0)
    local_a, local_b = [t - 0.01 * g for t, g in zip(theta, _params(1))], [t - 0.02 * g for t, g in zip(theta, _params(2))]
    a, learner_a, events_a = _syncer("a", theta, local_a)
    b, _, events_b = _syncer("b", theta, local_b)
    momentum = _params(9, 0.01)  # the outer momentum of earlier rounds (the same on both)
    for syncer in (a, b):
        state = syncer.states[0]
        syncer._publish(0, FragmentState(state.theta, [m.clone() for m in momentum], 0, state.hash))
    group = FakeGroup(2, failed_tensor=1)  # the reducer of the second tensor stopped answering
    a.averagers, b.averagers = [FakeAverager(a, group)], [FakeAverager(b, group)]
    _round(a, b)
    assert events_a[-1]["outcome"] == events_b[-1]["outcome"] == "ok"
    assert events_a[-1]["unaveraged"] == events_b[-1]["unaveraged"] == pytest.approx(0.4)  # 4 of 10 elements
    assert a.states[0].hash == b.states[0].hash  # the same Theta on both members
    merged = outer.weighted_mean([outer.pseudo_gradient(theta, local_a), outer.pseudo_gradient(theta, local_b)],
                                 [1.0, 1.0])
    merged[1] = torch.zeros_like(merged[1])  # nobody averaged it: a zero merged pseudo-gradient
    expected = [t.clone() for t in theta]
    outer.outer_step(expected, merged, [m.clone() for m in momentum], lr=0.7, momentum=0.9, nesterov=True)
    for got, want in zip(a.states[0].theta, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not torch.equal(expected[1], theta[1])  # (the outer momentum still moves Theta there)
    (update,) = learner_a.updates
    assert update.mode == "carry"
    # where nobody averaged, the progress is measured from the old Theta: the island keeps all of it
    torch.testing.assert_close(update.tensors[1], expected[1] - theta[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(update.tensors[0], expected[0] - local_a[0])


def test_a_listener_and_a_contributor_end_identical():
    """A member with nothing to contribute (no steps yet) weighs 1e-12: the contributor's result
    rounds back to exactly what it sent, which must not be taken for a failed part."""
    theta = _params(0)
    a, _, events_a = _syncer("a", theta, [t - 0.01 * g for t, g in zip(theta, _params(1))])
    b, learner_b, events_b = _syncer("b", theta, theta)
    learner_b.request_snapshot = lambda fragment, timeout: Snapshot(fragment, [p.clone() for p in theta], 0, 0)
    group = FakeGroup(2)
    a.averagers, b.averagers = [FakeAverager(a, group)], [FakeAverager(b, group)]
    _round(a, b)
    assert events_a[-1]["outcome"] == events_b[-1]["outcome"] == "ok"
    assert events_a[-1]["unaveraged"] == events_b[-1]["unaveraged"] == 0.0
    assert a.states[0].hash == b.states[0].hash


def test_a_member_on_a_fork_reloads_the_result_instead_of_keeping_it():
    theta = _params(0)
    fork = [t + 1e-3 for t in theta]
    a, _, events_a = _syncer("a", theta, [t - 0.01 for t in theta])
    b, learner_b, events_b = _syncer("b", fork, [t - 0.02 for t in fork])
    group = FakeGroup(2)
    a.averagers, b.averagers = [FakeAverager(a, group, donor=b)], [FakeAverager(b, group, donor=a)]
    _round(a, b)
    round_a, round_b = ([e for e in events if e["event"] == "round"][-1] for events in (events_a, events_b))
    winner, loser = (a, b) if round_a["canonical"] else (b, a)
    loser_round = round_b if loser is b else round_a  # (the winner's last event is the donation)
    assert loser_round["canonical"] is False and loser_round["reloaded"] is True
    assert loser.states[0].hash == winner.states[0].hash and loser.versions == winner.versions == [1]


def test_a_failed_round_falls_back_to_the_islands_own_pseudo_gradient():
    theta = _params(0)
    local = [t - 0.05 for t in theta]
    a, learner, events = _syncer("a", theta, local)
    a.averagers = [FakeAverager(a, FakeGroup(1, fail=True))]
    _round(a)
    assert events[-1]["outcome"] == "fallback" and a.stats.rounds_failed == 1 and a.versions == [1]
    expected = [t.clone() for t in theta]
    outer.outer_step(expected, outer.pseudo_gradient(theta, local), [torch.zeros_like(t) for t in theta],
                     lr=0.7, momentum=0.9, nesterov=True)
    for got, want in zip(a.states[0].theta, expected):
        torch.testing.assert_close(got, want)
    (update,) = learner.updates
    assert update.mode == "carry" and update.version == 1


def test_an_island_behind_the_swarm_reloads_before_contributing():
    theta = _params(0)
    donor, _, _ = _syncer("d", theta, theta)
    donor._publish(0, donor._stepped(donor.states[0], _params(5, 0.01), version=3, support=2))
    swarm = [("d", [3], [donor.states[0].hash]), ("e", [3], [donor.states[0].hash])]
    lagging, learner, events = _syncer("l", theta, theta, bases=lambda: swarm)
    group = FakeGroup(1, fail=True)
    lagging.averagers = [FakeAverager(lagging, group, donor=donor)]
    _round(lagging)
    reload, round_ = events[-2], events[-1]
    assert reload["event"] == "reload" and reload["why"] == "behind" and reload["reloaded"]
    assert learner.updates[0].mode == "carry" and learner.updates[0].version == 3  # local progress is kept
    # it then takes part in the same slot from the swarm's base, not with a stale pseudo-gradient
    (_, gather, _), = group.arrived
    assert gather["version"] == 3 and gather["hash"] == donor.states[0].hash
    assert round_["base_version"] == 3 and lagging.stats.reloads == 1


def test_an_island_that_cannot_reload_still_takes_part():
    """A swarm that looks newer but serves nothing must not make us skip rounds forever."""
    theta = _params(0)
    lagging, _, events = _syncer("l", theta, theta, bases=lambda: [("d", [3], ["x" * 16]), ("e", [3], ["x" * 16])])
    group = FakeGroup(1, fail=True)
    lagging.averagers = [FakeAverager(lagging, group, donor=None)]
    _round(lagging)
    assert events[-2]["event"] == "reload" and not events[-2]["reloaded"]
    assert len(group.arrived) == 1 and events[-1]["outcome"] == "fallback"


def test_a_tie_between_forks_is_left_to_the_round():
    theta = _params(0)
    a, _, events = _syncer("a", theta, theta, bases=lambda: [("d", [0], ["f" * 16])])  # one other island, another fork
    group = FakeGroup(1, fail=True)
    a.averagers = [FakeAverager(a, group)]
    assert a._repair_target(0, a.states[0]) is None
    b, _, _ = _syncer("b", theta, theta, bases=lambda: [("d", [0], ["f" * 16]), ("e", [0], ["f" * 16])])  # a majority
    assert b._repair_target(0, b.states[0]) == (0, "f" * 16)
    b.flagged = {"d": float("inf")}  # a flagged island's word does not count
    assert b._repair_target(0, b.states[0]) is None


def test_stopping_mid_round_is_not_a_failed_round():
    theta = _params(0)
    a, _, events = _syncer("a", theta, [t - 0.01 for t in theta])
    a.averagers = [FakeAverager(a, FakeGroup(2))]  # the second member never comes
    timer = threading.Timer(0.3, a._stop.set)
    timer.start()
    _round(a)
    assert events[-1]["outcome"] == "cancelled"
    assert a.stats.rounds_failed == 0 and a.versions == [0]


def test_nonfinite_local_parameters_are_never_sent_and_get_replaced():
    theta = _params(0)
    broken = [t.clone() for t in theta]
    broken[0][0, 0] = float("nan")
    a, learner, events = _syncer("a", theta, broken)
    group = FakeGroup(2)
    a.averagers = [FakeAverager(a, group)]
    _round(a)
    assert events[-1]["outcome"] == "nonfinite" and not group.arrived
    (update,) = learner.updates
    assert update.mode == "replace" and update.reset_optimizer
    assert all(torch.equal(x, y) for x, y in zip(update.tensors, theta))


def test_donated_state_is_a_copy():
    theta = _params(0)
    a, _, _ = _syncer("a", theta, theta)
    metadata, tensors = a._donate(0)
    assert metadata["version"] == 0 and metadata["hash"] == a.states[0].hash
    assert all(t.data_ptr() != s.data_ptr() for t, s in zip(tensors, a.states[0].theta + a.states[0].momentum))


@pytest.mark.parametrize("garbage", ["nan", "inf", "huge"])
def test_a_member_sending_garbage_is_rejected_flagged_and_avoided(garbage):
    theta = _params(0)
    honest = [_syncer(name, theta, [t - 0.01 for t in theta]) for name in ("a", "b")]
    faulty = _syncer("x", theta, [t - 0.01 for t in theta], corrupt=garbage)
    group = FakeGroup(3)
    for syncer, _, _ in honest + [faulty]:
        syncer.averagers = [FakeAverager(syncer, group)]
    _round(*(s for s, _, _ in honest + [faulty]))
    for syncer, learner, events in honest:
        assert events[-1]["outcome"] == "rejected" and events[-1]["culprits"] == ["x"]
        assert syncer.versions == [0] and syncer.states[0].hash == honest[0][0].states[0].hash  # nothing applied
        assert outer.all_finite(syncer.states[0].theta) and not learner.updates
        assert list(syncer.flagged) == ["x"] and syncer.stats.rounds_rejected == 1
    assert faulty[2][-1]["outcome"] == "rejected" and faulty[2][-1]["culprits"] == []  # it blames nobody
    # the next round: the honest islands change their group key, the faulty one does not
    for syncer, _, _ in honest + [faulty]:
        syncer.averagers = [FakeAverager(syncer, FakeGroup(1, fail=True))]
    _round(*(s for s, _, _ in honest + [faulty]))
    bits = {s.averagers[0].group_bits for s, _, _ in honest}
    assert len(bits) == 1 and bits != {""} and faulty[0].averagers[0].group_bits == ""


def test_a_flag_ends_after_its_probation_which_doubles_with_each_strike(monkeypatch):
    theta = _params(0)
    a, _, events = _syncer("a", theta, theta)
    a.averagers = [FakeAverager(a, FakeGroup(1, fail=True))]
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    assert a._flag("x", "caught") == CONFIG.flag_probation
    a._keep_away_from_flagged(a.averagers[0])
    flagged_bits = a.averagers[0].group_bits
    assert "x" in a.flagged and len(flagged_bits) == 8
    assert a._flag("x", "caught") == 0.0  # flagged already: no second strike
    until = a.flagged["x"]  # the probation, rounded up to halfway between two rounds' checks
    assert CONFIG.flag_probation <= until - 1000.0 < CONFIG.flag_probation + CONFIG.period
    assert (until + CONFIG.matchmaking_time) % CONFIG.period == pytest.approx(CONFIG.period / 2)
    now[0] = until - 0.5
    a._keep_away_from_flagged(a.averagers[0])
    assert "x" in a.flagged and a.averagers[0].group_bits == flagged_bits
    now[0] = until + 0.5  # probation over: back to the default group key, where the others meet x again
    a._keep_away_from_flagged(a.averagers[0])
    assert "x" not in a.flagged and a.averagers[0].group_bits == ""
    assert [e["event"] for e in events[-2:]] == ["flag", "unflag"]
    assert a._flag("x", "caught") == 2 * CONFIG.flag_probation  # caught again: twice as long
    assert events[-1] == {"event": "flag", "culprit": "x", "how": "caught", "seconds": 2 * CONFIG.flag_probation}


class FailedControl(FakeControl):
    """Like hivemind's MPFuture after a failed round: it keeps one exception object and raises it."""

    def __init__(self, group):
        super().__init__(group)
        self.exception = RuntimeError("could not find a group")

    def result(self, timeout=None):
        raise self.exception


class FailingAverager(FakeAverager):
    def step(self, *, gather, weight, **_):
        return FailedControl(self.group)


def test_a_failed_round_frees_its_tensors_without_the_cyclic_gc():
    # the failed future's exception must not keep the round's frames (snapshot, pseudo-gradient)
    # alive in a reference cycle: the island's memory would grow with every failed round
    import gc
    import weakref

    theta = _params(0)
    a, learner, events = _syncer("a", theta, [t - 0.05 for t in theta])
    a.averagers = [FailingAverager(a, FakeGroup(2))]
    taken = []
    request = learner.request_snapshot

    def tracked(fragment, timeout):
        snapshot = request(fragment, timeout)
        taken.append(weakref.ref(snapshot.params[0]))
        return snapshot

    learner.request_snapshot = tracked
    gc.collect()
    gc.disable()
    try:
        _round(a)
        assert events[-1]["outcome"] == "fallback"
        assert taken and taken[0]() is None
    finally:
        gc.enable()


def test_a_restarted_island_adopts_the_flags_of_a_majority():
    a, _, _ = _syncer("a", _params(0), _params(0))
    assert a.adopt_flags([("b", ["x"]), ("c", []), ("x", [])]) == []  # 1 of 2 voters (x has no say on itself)
    assert a.adopt_flags([("b", ["x", "a"]), ("c", ["x"]), ("x", ["b", "c"])]) == ["x"]
    assert "x" in a.flagged and "a" not in a.flagged  # never flags itself
    assert a.adopt_flags([("b", ["x"]), ("c", ["x"])]) == []  # already flagged
    a.flagged.clear()  # our probation of x is over while the others' still runs
    assert a.adopt_flags([("b", ["x"]), ("c", ["x"])]) == []  # no re-adopting: our own probation decides


@pytest.mark.parametrize("codec,merge", [("int4", "mean"), ("none", "rda"), ("int4", "rda"), ("int2", "mean")])
def test_compressed_and_rda_rounds_keep_members_identical_and_errors_local(codec, merge):
    config = CONFIG.model_copy(update={"codec": codec, "merge": merge})
    theta = _params(0)
    local_a, local_b = [t - 0.01 * g for t, g in zip(theta, _params(1))], [t - 0.03 * g for t, g in zip(theta, _params(2))]
    a, learner_a, events_a = _syncer("a", theta, local_a, config=config)
    b, learner_b, events_b = _syncer("b", theta, local_b, config=config)
    group = FakeGroup(2)
    a.averagers, b.averagers = [FakeAverager(a, group)], [FakeAverager(b, group)]
    _round(a, b)
    assert events_a[-1]["outcome"] == events_b[-1]["outcome"] == "ok"
    assert a.states[0].hash == b.states[0].hash  # bit-identical Theta on both members
    deltas = [outer.pseudo_gradient(theta, local_a), outer.pseudo_gradient(theta, local_b)]
    expected = (outer.rda_mean if merge == "rda" else outer.weighted_mean)(deltas, [1.0, 1.0])
    # the first Nesterov step moves Theta by lr * (1 + momentum) * merged
    merged = [(t - new) / (0.7 * 1.9) for t, new in zip(theta, a.states[0].theta)]
    for j, (got, want) in enumerate(zip(merged, expected)):  # within half a grid step of the exact merge
        largest = max(float(d[j].abs().max()) for d in deltas)
        tolerance = 1e-5 if codec == "none" else largest * (1.0 / wire.LEVELS[codec] + 0.05) * (2 if merge == "rda" else 1)
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance)
    # what was not sent stays local: carry = Theta_new - (snapshot + residual), |residual| <= half a step
    for learner, local in ((learner_a, local_a), (learner_b, local_b)):
        update = learner.updates[-1]
        assert update.mode == "carry"
        residual = [new - carry - snap for new, carry, snap in zip(a.states[0].theta, update.tensors, local)]
        for j, r in enumerate(residual):  # the grid's step fits the larger member's values
            levels = wire.LEVELS.get(codec, 0)
            largest = max(float(d[j].abs().max()) for d in deltas)
            bound = largest / levels if levels else 1e-6
            assert float(r.abs().max()) <= bound * 1.001 + 1e-6
        if codec != "none":
            assert any(float(r.abs().max()) > 0 for r in residual)  # quantization error kept for next time
    assert events_a[-1]["bytes_sent"] > 0 and events_a[-1]["bytes_received"] > 0
    assert a.stats.bytes_sent == a.stats.round_bytes_sent == events_a[-1]["bytes_sent"]


def test_rda_keeps_embeddings_on_the_plain_mean():
    layout = FragmentLayout(fragments=(("embed_tokens.weight", "w"),), sizes=(10,))
    a, _, _ = _syncer("a", _params(0), _params(1), config=CONFIG.model_copy(update={"merge": "rda"}), layout=layout)
    assert a.rda == [[False, True]]
    assert a.offsets[0][0] == a.offset and a.offsets[0][1] == outer.wire_offset(1.0)


@pytest.mark.parametrize("codec,merge,lie", [
    ("none", "rda", lambda g: g | {"norms": [1e300] * len(g["norms"])}),  # no clipped Delta is that long
    ("int4", "mean", lambda g: g | {"exponents": np.full(len(g["exponents"]) // 2, 30, "<i2").tobytes()}),
    ("int4", "mean", lambda g: g | {"delta_max": float("inf")}),
])
def test_a_member_lying_in_its_metadata_gets_the_round_rejected_and_is_flagged(codec, merge, lie):
    config = CONFIG.model_copy(update={"codec": codec, "merge": merge})
    theta = _params(0)
    a, learner_a, events_a = _syncer("a", theta, [t - 0.01 * g for t, g in zip(theta, _params(1))], config=config)
    b, _, _ = _syncer("b", theta, [t - 0.02 * g for t, g in zip(theta, _params(2))], config=config)
    group = FakeGroup(2)
    a.averagers, b.averagers = [FakeAverager(a, group)], [FakeAverager(b, group)]
    b.averagers[0].tamper = lie
    _round(a, b)
    assert events_a[-1]["outcome"] == "rejected" and events_a[-1]["culprits"] == ["b"]
    assert "b" in a.flagged and a.versions == [0] and not learner_a.updates


def test_a_member_with_a_non_finite_weight_is_not_a_member():
    theta = _params(0)
    a, _, events_a = _syncer("a", theta, [t - 0.01 * g for t, g in zip(theta, _params(1))])
    b, _, _ = _syncer("b", theta, [t - 0.02 * g for t, g in zip(theta, _params(2))])
    group = FakeGroup(2)
    a.averagers, b.averagers = [FakeAverager(a, group)], [FakeAverager(b, group)]
    b.averagers[0].tamper = lambda g: g | {"weight": float("nan")}
    _round(a, b)
    assert events_a[-1]["outcome"] == "fallback" and events_a[-1]["group_size"] == 1


def test_a_listener_keeps_its_whole_pseudo_gradient_for_later():
    config = CONFIG.model_copy(update={"codec": "int4"})
    theta = _params(0)
    local_a = [t - 0.01 * g for t, g in zip(theta, _params(1))]
    a, learner_a, events_a = _syncer("a", theta, local_a, config=config)
    b, _, _ = _syncer("b", theta, [t - 0.02 * g for t, g in zip(theta, _params(2))], config=config)
    learner_a.request_snapshot = lambda fragment, timeout: Snapshot(fragment, [p.clone() for p in local_a], 0, 0)
    group = FakeGroup(2)
    a.averagers, b.averagers = [FakeAverager(a, group)], [FakeAverager(b, group)]
    _round(a, b)
    assert events_a[-1]["outcome"] == "ok" and events_a[-1]["weight"] == 0.0
    update = learner_a.updates[-1]
    base = [new - carry for new, carry in zip(a.states[0].theta, update.tensors)]
    for got, want in zip(base, theta):  # base = snapshot + Delta = the old Theta: all local progress kept
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
