"""The syncer's parts as pure logic (no network): the quarantine with its clock passed in, the base
repair's choice, the round's checks of what members report, and the rounds that need no group
(fallback, cancelled, non-finite, lagging) through a channel test double. What a real group does
(members bit-identical, failed parts, weights, RDA, low-bit grids) is checked with real hivemind
averagers in tests/integration/test_rounds.py."""

from __future__ import annotations

import math

import threading
import time

import numpy as np
import pytest
import torch

from p2p_diloco.algo import outer, wire
from p2p_diloco.algo.fragments import FragmentLayout
from p2p_diloco.algo.schedule import RoundSlot
from p2p_diloco.config import OuterConfig
from p2p_diloco.island.contribution import RoundFormat
from p2p_diloco.island.quarantine import Quarantine, caught_flags
from p2p_diloco.island.store import FragmentState, FragmentStore
from tests.doubles import ChannelDouble, IslandParts, LearnerDouble

SHAPES = [torch.Size([3, 2]), torch.Size([4])]
LAYOUT = FragmentLayout(fragments=(("w", "b"),), sizes=(10,))
CONFIG = OuterConfig(period=10.0, fragments=1, matchmaking_time=1.0, grace_window=0.2, allreduce_timeout=1.0,
                     request_timeout=0.2)


class Island(IslandParts):
    """One island's syncer over a channel double."""

    def __init__(self, name, theta, local, channel, bases=lambda: [], config=CONFIG):
        super().__init__(name, theta, local, shapes=SHAPES, names=LAYOUT.fragments[0], config=config,
                         open_channel=lambda parts: channel, bases=bases)

    def round(self):
        self.syncer._run_round(0, RoundSlot(time.time() + 0.1, 0, 7))
        return self.last


def _params(seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * scale for shape in SHAPES]


def test_a_failed_round_steps_on_the_islands_own_pseudo_gradient_when_not_deferred():
    theta = _params(0)
    local = [t - 0.05 for t in theta]
    island = Island("a", theta, local, ChannelDouble(SHAPES, result=None), config=CONFIG.model_copy(update={"fallback_defer": 0}))
    event = island.round()
    assert event["outcome"] == "fallback" and event["group_size"] == 1 and "deferred" not in event
    assert island.stats.rounds_failed == 1 and island.store.versions == [1]
    expected = [t.clone() for t in theta]
    outer.outer_step(expected, outer.pseudo_gradient(theta, local), [torch.zeros_like(t) for t in theta],
                     lr=0.7, momentum=0.9, nesterov=True)
    for got, want in zip(island.store.states[0].theta, expected):
        torch.testing.assert_close(got, want)
    (update,) = island.learner.updates
    assert update.mode == "carry" and update.version == 1 and update.reason == "fallback"
    assert event["new_version"] == 1 and event["new_hash"] == island.store.hashes[0]


def test_failed_rounds_carry_the_islands_work_into_the_next_round_then_step():
    """A round that finds no group leaves Theta_p alone (the learner keeps all its progress), and the
    next round claims the tokens and steps of both; after ``fallback_defer`` deferrals in a row the
    island steps on its own pseudo-gradient, which covers the whole stretch."""
    theta = _params(0)
    island = Island("a", theta, [t - 0.05 for t in theta], ChannelDouble(SHAPES, result=None),
                    config=CONFIG.model_copy(update={"fallback_defer": 2}))
    first, second = island.round(), island.round()
    assert first["outcome"] == second["outcome"] == "fallback" and first["deferred"] and second["deferred"]
    assert island.store.versions == [0] and not island.learner.updates and island.stats.rounds_failed == 2
    assert first["new_version"] == 0 and first["new_hash"] == island.store.hashes[0]
    tokens, steps = island.learner.tokens, island.learner.steps
    assert [g["tokens"] for g in island.channel.gathers] == [tokens, 2 * tokens]
    assert [g["steps"] for g in island.channel.gathers] == [steps, 2 * steps]
    island.learner.params = [t - 0.1 for t in theta]  # the learner trained on meanwhile
    third = island.round()
    assert "deferred" not in third and island.store.versions == [1] and island.channel.gathers[-1]["tokens"] == 3 * tokens
    assert third["weight"] == pytest.approx(outer.token_weight(3 * tokens, 3 * steps) / 1e6, rel=1e-6)
    expected = [t.clone() for t in theta]
    outer.outer_step(expected, outer.pseudo_gradient(theta, island.learner.params), [torch.zeros_like(t) for t in theta],
                     lr=0.7, momentum=0.9, nesterov=True)
    for got, want in zip(island.theta, expected):
        torch.testing.assert_close(got, want)
    island.round()  # the count starts again after a landed state: deferred, claiming one round's tokens
    assert island.last["deferred"] and island.channel.gathers[-1]["tokens"] == tokens and island.store.versions == [1]


def test_a_group_of_one_valid_member_is_a_fallback_too():
    """A member whose metadata is malformed (a NaN weight) is not a member."""
    theta = _params(0)
    island = Island("a", theta, [t - 0.05 for t in theta], ChannelDouble(SHAPES))
    island.channel.result = {"me": None, "other": {"island": "b", "version": 0, "hash": "x", "weight": float("nan")}}
    event = island.round()
    assert event["outcome"] == "fallback" and event["group_size"] == 0 and island.stats.rounds_failed == 1


def test_an_island_behind_the_swarm_reloads_before_contributing():
    theta = _params(0)
    donor = Island("d", theta, theta, ChannelDouble(SHAPES))
    donor.store.publish(0, donor.store.states[0].stepped(_params(5, 0.01), 3, 2, lr=0.7, momentum=0.9, nesterov=True))
    swarm = [("d", [3], [donor.store.hashes[0]]), ("e", [3], [donor.store.hashes[0]])]
    lagging = Island("l", theta, theta, ChannelDouble(SHAPES, result=None, donor=donor.transfer), bases=lambda: swarm)
    event = lagging.round()
    reload = [e for e in lagging.events if e["event"] == "reload"][-1]
    assert reload["why"] == "behind" and reload["reloaded"] and reload["new_version"] == 3
    assert lagging.learner.updates[0].mode == "carry" and lagging.learner.updates[0].version == 3  # progress kept
    # it then takes part in the same slot from the swarm's base, not with a stale pseudo-gradient
    (gather,) = lagging.channel.gathers
    assert gather["version"] == 3 and gather["hash"] == donor.store.hashes[0]
    assert event["base_version"] == 3 and lagging.stats.reloads == 1 and lagging.stats.state_bytes_received > 0
    assert donor.stats.state_bytes_sent == lagging.stats.state_bytes_received


def test_a_resumed_island_does_not_send_the_checkpoints_progress_twice():
    """After a restart from a checkpoint at v_p = 0 the swarm holds v_p = 3, which may include the
    checkpoint's progress (rounds the killed process joined): the reload keeps only the progress
    made since the restart and the next snapshot claims only its tokens, even when the first round
    after the restart landed nothing (a deferred fallback), and under ``apply = "mix"`` too."""
    theta = _params(0)
    donor = Island("d", theta, theta, ChannelDouble(SHAPES))
    donor.store.publish(0, donor.store.states[0].stepped(_params(5, 0.01), 3, 2, lr=0.7, momentum=0.9, nesterov=True))
    newer = [("d", [3], [donor.store.hashes[0]]), ("e", [3], [donor.store.hashes[0]])]
    saved = [t - 0.05 for t in theta]  # the checkpoint's local parameters
    for apply in ("carry", "mix"):
        swarm = []
        resumed = Island("r", theta, [t - 0.02 for t in saved], ChannelDouble(SHAPES, result=None, donor=donor.transfer),
                         bases=lambda: swarm, config=CONFIG.model_copy(update={"apply": apply}))
        resumed.syncer.repair.resumed(0, 0, saved, (1000, 40))
        assert resumed.round()["deferred"] and not resumed.learner.updates  # nothing landed: still marked
        swarm[:] = newer
        resumed.round()
        reload = [e for e in resumed.events if e["event"] == "reload"][-1]
        assert reload["reloaded"] and reload["from_checkpoint"] and reload["new_version"] == 3
        (update,) = resumed.learner.updates
        assert update.mode == "carry" and update.marks == (1000, 40)  # Theta_3 + (local - saved): 0.02, not 0.07
        for correction, new, old in zip(update.tensors, donor.store.states[0].theta, saved):
            torch.testing.assert_close(correction, new - old)


def test_a_resumed_island_keeps_its_checkpoints_progress_where_the_swarm_did_not_move_on():
    """A reload at the checkpoint's own version (we resumed on a lone fork) measures progress from
    Theta_p as any reload does: no round after the checkpoint can have landed."""
    theta = _params(0)
    fork = Island("d", _params(1), theta, ChannelDouble(SHAPES))
    swarm = [("d", [0], [fork.store.hashes[0]]), ("e", [0], [fork.store.hashes[0]])]
    resumed = Island("r", theta, [t - 0.05 for t in theta], ChannelDouble(SHAPES, result=None, donor=fork.transfer),
                     bases=lambda: swarm)
    resumed.syncer.repair.resumed(0, 0, [t - 0.03 for t in theta], (1000, 40))
    resumed.round()
    reload = [e for e in resumed.events if e["event"] == "reload"][-1]
    assert reload["reloaded"] and "from_checkpoint" not in reload and reload["new_version"] == 0
    (update,) = resumed.learner.updates
    assert update.marks is None
    for correction, new, old in zip(update.tensors, fork.store.states[0].theta, theta):
        torch.testing.assert_close(correction, new - old)


def test_an_island_that_cannot_reload_still_takes_part():
    """A swarm that looks newer but serves nothing must not make us skip rounds forever."""
    theta = _params(0)
    island = Island("l", theta, theta, ChannelDouble(SHAPES, result=None), bases=lambda: [("d", [3], ["x" * 16]), ("e", [3], ["x" * 16])])
    event = island.round()
    assert [e for e in island.events if e["event"] == "reload"][-1]["reloaded"] is False
    assert len(island.channel.gathers) == 1 and event["outcome"] == "fallback"


def test_stopping_mid_round_is_not_a_failed_round():
    theta = _params(0)
    island = Island("a", theta, [t - 0.01 for t in theta], ChannelDouble(SHAPES, block=True))
    timer = threading.Timer(0.3, island.stop.set)
    timer.start()
    event = island.round()
    assert event["outcome"] == "cancelled" and "new_version" not in event
    assert island.stats.rounds_failed == 0 and island.store.versions == [0] and not island.learner.updates


def test_nonfinite_local_parameters_are_never_sent_and_get_replaced():
    theta = _params(0)
    broken = [t.clone() for t in theta]
    broken[0][0, 0] = float("nan")
    island = Island("a", theta, broken, ChannelDouble(SHAPES))
    event = island.round()
    assert event["outcome"] == "nonfinite" and not island.channel.gathers and island.stats.rounds_skipped == 1
    (update,) = island.learner.updates
    assert update.mode == "replace" and update.reset_optimizer and update.reason == "reload"
    assert all(torch.equal(x, y) for x, y in zip(update.tensors, theta))


def test_a_donated_state_is_a_copy_and_counts_its_bytes():
    theta = _params(0)
    island = Island("a", theta, theta, ChannelDouble(SHAPES))
    metadata, tensors = island.transfer.donate(0)
    state = island.store.states[0]
    assert metadata == {"fingerprint": "f" * 16, "fragment": 0, "version": 0, "hash": state.hash, "support": 1}
    assert all(t.data_ptr() != s.data_ptr() and torch.equal(t, s) for t, s in zip(tensors, state.theta + state.momentum))
    assert island.stats.state_bytes_sent == 2 * 10 * 4


def test_a_download_is_checked_not_trusted():
    theta = _params(0)
    island = Island("a", theta, theta, ChannelDouble(SHAPES))
    good = Island("d", theta, theta, ChannelDouble(SHAPES)).transfer.donate(0)
    for bad in ({**good[0], "fingerprint": "other"}, {**good[0], "fragment": 1}, {**good[0], "version": -1}):
        island.channel.load_state = lambda timeout, bad=bad: (bad, good[1])
        assert island.transfer.download(0, min_version=0, timeout=1.0) is None
    nan = [t.clone() for t in good[1]]
    nan[0][0, 0] = float("nan")
    island.channel.load_state = lambda timeout: (good[0], nan)
    assert island.transfer.download(0, min_version=0, timeout=1.0) is None
    island.channel.load_state = lambda timeout: (good[0], good[1])
    assert island.transfer.download(0, among={(0, "0" * 16)}, timeout=1.0) is None  # another fork
    state = island.transfer.download(0, min_version=0, timeout=1.0)
    assert state.hash == outer.tensors_hash(theta)  # computed here, not taken from the donor


def test_a_download_of_a_known_state_asks_the_donors_whose_records_show_it_then_anyone():
    theta = _params(0)
    island = Island("a", theta, theta, ChannelDouble(SHAPES))
    good = Island("d", theta, theta, ChannelDouble(SHAPES)).transfer.donate(0)
    wanted = (0, good[0]["hash"])
    island.transfer.holders = lambda: [("P1", [0], [wanted[1]]), ("P2", [0], ["0" * 16]), ("P3", [0], [wanted[1]]),
                                       ("P4", [], [])]
    assert sorted(island.transfer.holders_of(0, {wanted})) == ["P1", "P3"]
    asked = []

    def load_state(timeout, peers=None):
        asked.append(peers)
        return (good[0], good[1]) if peers is None else None  # the holders moved on: hivemind's pick serves it

    island.channel.load_state = load_state
    state = island.transfer.download(0, among={wanted}, timeout=5.0)
    assert state is not None and state.hash == wanted[1]
    assert sorted(asked[0]) == ["P1", "P3"] and asked[1:] == [None]
    asked.clear()
    assert island.transfer.download(0, min_version=0, timeout=5.0) is not None and asked == [None]  # any state


def test_repair_reloads_a_newer_version_or_a_majority_fork_but_leaves_ties_to_the_round():
    theta = _params(0)
    fork = "f" * 16
    island = Island("a", theta, theta, ChannelDouble(SHAPES), bases=lambda: [("d", [0], [fork])])
    state = island.store.states[0]
    assert island.syncer.repair.target(0, state) is None  # one other island on another fork: a tie
    island.syncer.repair.swarm_bases = lambda: [("d", [0], [fork]), ("e", [0], [fork])]
    assert island.syncer.repair.target(0, state) == (0, fork)  # a majority
    island.quarantine.flag("d", "caught", time.time())
    assert island.syncer.repair.target(0, state) is None  # a flagged island's word does not count
    island.syncer.repair.swarm_bases = lambda: [("e", [2], ["b" * 16]), ("g", [2], ["b" * 16]), ("h", [3], ["c" * 16])]
    assert island.syncer.repair.target(0, state) == (2, "b" * 16)  # the newest version 2 or more hold wins
    island.syncer.repair.swarm_bases = lambda: [("e", [2], ["b" * 16]), ("g", [1], ["c" * 16])]
    assert island.syncer.repair.target(0, state) is None  # one island's word: not enough (docs/SECURITY.md)
    island.syncer.repair.swarm_bases = lambda: [("e", [2], ["b" * 16])]
    assert island.syncer.repair.target(0, state) == (2, "b" * 16)  # the only other island: nobody to ask


def test_a_flag_ends_after_its_probation_which_doubles_with_each_strike():
    events = []
    quarantine = Quarantine(island="a", probation=CONFIG.flag_probation, slot_spacing=CONFIG.fragment_budget,
                            check_lead=CONFIG.matchmaking_time, events=events.append)
    assert quarantine.group_bits(1000.0) is None  # never flagged anyone: the default key, untouched
    assert quarantine.flag("x", "caught", 1000.0) == CONFIG.flag_probation
    bits = quarantine.group_bits(1000.0)
    assert "x" in quarantine and len(bits) == 8 and set(bits) <= {"0", "1"}
    assert quarantine.flag("x", "caught", 1001.0) == 0.0  # flagged already: no second strike
    until = quarantine.flagged["x"]  # the probation, rounded up to halfway between two rounds' checks
    assert CONFIG.flag_probation <= until - 1000.0 < CONFIG.flag_probation + CONFIG.period
    assert (until + CONFIG.matchmaking_time) % CONFIG.period == pytest.approx(CONFIG.period / 2)
    assert quarantine.group_bits(until - 0.5) == bits and "x" in quarantine
    assert quarantine.group_bits(until + 0.5) == ""  # over: back to the default key, where the others meet x
    assert "x" not in quarantine and [e["event"] for e in events] == ["flag", "unflag"]
    assert quarantine.flag("x", "caught", until + 1.0) == 2 * CONFIG.flag_probation  # caught again: twice as long
    assert events[-1] == {"event": "flag", "culprit": "x", "how": "caught", "seconds": 2 * CONFIG.flag_probation,
                          "reason": "garbage"}


def test_islands_that_flagged_the_same_ones_share_group_bits():
    a, b = (Quarantine(island=n, probation=60.0, slot_spacing=5.0, check_lead=1.0) for n in ("a", "b"))
    a.flag("x", "caught", 0.0), b.flag("x", "caught", 3.0), b.flag("y", "caught", 3.0)
    assert a.group_bits(4.0) != b.group_bits(4.0)  # b also avoids y
    a.flag("y", "caught", 4.0)
    assert a.group_bits(4.0) == b.group_bits(4.0)


def test_a_restarted_island_adopts_the_flags_of_a_majority():
    quarantine = Quarantine(island="a", probation=60.0, slot_spacing=5.0, check_lead=1.0)
    assert quarantine.adopt([("b", ["x"]), ("c", []), ("x", [])], 0.0) == []  # 1 of 2 voters (x has no say)
    assert quarantine.adopt([("b", ["x", "a"]), ("c", ["x"]), ("x", ["b", "c"])], 0.0) == ["x"]
    assert "x" in quarantine and "a" not in quarantine  # never flags itself
    assert quarantine.adopt([("b", ["x"]), ("c", ["x"])], 1.0) == []  # already flagged
    quarantine.expire(1e9)  # our probation of x is over while the others' caught ones still run
    # adopted once on the others' word alone: not again in this life (in a small swarm the majority
    # of the others can be one liar, who must not keep an honest island out for ever)
    assert quarantine.adopt([("b", ["x"]), ("c", ["x"])], 1e9) == []


def test_islands_that_missed_an_attack_join_the_majority_that_caught_it():
    """Run H3 (docs/CHAOS.md): d caught x once; later b and c caught it again while d did not meet it.
    d adopts their flag, so the honest islands meet under one group key instead of stepping two forks
    of one version in two groups. Adopted flags have no vote (islands would keep them alive)."""
    events = []
    d = Quarantine(island="d", probation=60.0, slot_spacing=5.0, check_lead=1.0, events=events.append)
    d.flag("x", "caught", 0.0)
    d.expire(1000.0)
    assert d.adopt([("b", ["x"]), ("c", ["x"]), ("e", []), ("x", [])], 1000.0) == ["x"]
    assert events[-1]["seconds"] == 120.0 and d.strikes == {"x": 1}  # a cap one doubling past ours; no strike
    d.expire(1200.0)  # the cap ran out while the majority still holds its catches: adopted again
    assert d.adopt([("b", ["x"]), ("c", ["x"]), ("e", [])], 1200.0) == ["x"] and d.strikes == {"x": 1}
    b = Quarantine(island="b", probation=60.0, slot_spacing=5.0, check_lead=1.0)
    b.flag("x", "caught", 990.0)
    assert d.group_bits(1000.0) == b.group_bits(1000.0)
    assert caught_flags(["x", "y"], {"x": "adopted", "y": "outlier"}) == ["y"]
    assert caught_flags(["x"], {}) == ["x"]  # a record without reasons: its flags are its catches
    f = Quarantine(island="f", probation=60.0, slot_spacing=5.0, check_lead=1.0)
    adopted_only = caught_flags(["x"], {"x": "adopted"})
    assert f.adopt([("b", adopted_only), ("c", adopted_only), ("e", [])], 0.0) == [] and "x" not in f


def test_an_adopted_flag_ends_when_the_majority_lifts_theirs():
    """A restarted island adopted x's flag; the others' probations, begun earlier, end first. It lifts
    its own after two reads in a row without a majority (not a whole probation later, alone under
    another group key), while a flag it caught itself stays its own to end."""
    events = []
    quarantine = Quarantine(island="a", probation=60.0, slot_spacing=5.0, check_lead=1.0, events=events.append)
    assert quarantine.adopt([("b", ["x"]), ("c", ["x"]), ("d", [])], 0.0) == ["x"]
    quarantine.flag("y", "caught", 0.0)
    # x's own record has no say: 2 of 3, held
    assert quarantine.adopt([("b", ["x", "y"]), ("c", ["x"]), ("d", []), ("x", [])], 5.0) == [] and "x" in quarantine
    assert quarantine.adopt([], 6.0) == [] and "x" in quarantine  # a failed read lifts nothing
    assert quarantine.adopt([("d", [])], 7.0) == [] and "x" in quarantine  # one read without the holders: held
    assert quarantine.adopt([("b", ["x"]), ("c", ["x"]), ("d", [])], 8.0) == [] and "x" in quarantine
    assert quarantine.adopt([("b", ["x"]), ("c", []), ("d", [])], 10.0) == [] and "x" in quarantine  # 1 of 3, once
    assert quarantine.adopt([("b", ["x"]), ("c", [])], 11.0) == []  # 1 of 2 (a tie is no majority), twice in a row
    assert "x" not in quarantine and "y" in quarantine  # y: caught by us, our probation decides
    assert events[-1] == {"event": "unflag", "culprit": "x", "how": "released"}
    only_y = Quarantine(island="e", probation=60.0, slot_spacing=5.0, check_lead=1.0)
    only_y.flag("y", "caught", 0.0)
    assert quarantine.group_bits(11.0) == only_y.group_bits(11.0)  # it meets those that avoid y alone
    # lifted, x is not adopted again by an island that never caught it itself
    assert quarantine.adopt([("b", ["x"]), ("c", ["x"]), ("d", ["x"])], 20.0) == [] and "x" not in quarantine
    # y was caught, never adopted: no majority of the others' word lifts it
    assert quarantine.adopt([("b", []), ("c", []), ("d", [])], 22.0) == [] and quarantine.adopt([("b", [])], 23.0) == []
    assert "y" in quarantine


def _member(island, **fields):
    # 1000 tokens in 1 step: weight 1000^2 / 1 / WEIGHT_UNIT = 1.0
    return {"island": island, "version": 0, "hash": "h", "weight": 1.0, "tokens": 1000, "steps": 1, "delta_max": 0.5,
            "delta_norm": 1.5, "norms": [1.0, 1.0], **fields}


@pytest.mark.parametrize("codec,merge,lie", [
    ("none", "mean", {"delta_max": float("nan")}),
    ("none", "mean", {"delta_max": float("inf")}),
    ("none", "mean", {"delta_max": 1e30}),
    ("none", "mean", {"delta_norm": 1e30}),  # no clipped Delta is that long
    ("none", "mean", {"delta_norm": -1.0}),
    ("none", "mean", {"delta_norm": None}),
    ("none", "mean", {"delta_norm": 0.1}),  # shorter than its own largest value (0.5): it would stall bounded rounds
    ("none", "mean", {"weight": 1e6}),  # not tokens^2 / steps of its own claims
    ("none", "mean", {"tokens": None}),
    ("none", "rda", {"norms": [1e300, 1.0]}),  # no clipped Delta is that long
    ("none", "rda", {"norms": [1.0]}),
    ("none", "rda", {"delta_norm": 1.2}),  # shorter than the norm of its RDA norms (1, 1): sqrt(2)
    ("int4", "mean", {"exponents": np.full(2, 30, "<i2").tobytes()}),  # a grid coarser than its values need
    ("int4", "mean", {"exponents": b"x"}),
])
def test_members_whose_metadata_no_honest_member_sends_are_named(codec, merge, lie):
    fmt = RoundFormat(CONFIG.model_copy(update={"codec": codec, "merge": merge}), ("w", "b"), SHAPES)
    honest = _member("a")
    if codec != "none":
        honest["exponents"] = fmt.write(fmt.contribution(_params(1, 0.01), 10, 1), [torch.zeros(s) for s in SHAPES])["exponents"]
    liar = honest | {"island": "b"} | lie
    assert fmt.misreporting([honest, liar], "a") == ["b"]
    assert fmt.misreporting([honest, liar], "b") == []  # nobody names itself


def test_a_round_is_bounded_by_its_contributors_lower_median_update_unless_the_run_says_otherwise():
    merged = [torch.full(s, 0.1) for s in SHAPES]  # ||merged|| = 0.1 sqrt(numel)
    length = 0.1 * math.sqrt(sum(s.numel() for s in SHAPES))
    pair = [_member("a", delta_norm=length / 1.5, delta_max=0.1), _member("b", delta_norm=100.0)]
    listener = _member("l", weight=0.0, tokens=0, steps=0, delta_norm=0.0)
    bounded = RoundFormat(CONFIG, ("w", "b"), SHAPES)
    assert bounded.halvings(merged, pair) == bounded.halvings(merged, pair + [listener]) == 0
    pair[0]["delta_norm"] = length / 2.5  # the shorter one counts, whatever the other claims
    assert bounded.halvings(merged, pair) == bounded.halvings(merged, pair + [listener]) == 1
    # 2 colluding claims of 4 cannot lift the lower median above the honest ones
    four = pair + [_member("c", delta_norm=length / 3), _member("d", delta_norm=1e6)]
    assert bounded.halvings(merged, four) == 1  # median_low(L/3, L/2.5, 100, 1e6) = L/2.5
    assert bounded.halvings(merged, pair[1:] + [_member("c", delta_norm=length)]) == 0  # median L: within 2x
    assert bounded.halvings(merged, [pair[0]]) == 0  # 1 contributor: a fallback's business
    # pair evidence: only from a round of exactly 2 contributors, one of them us
    assert bounded.pair_partner(pair + [listener], "a") == "b" and bounded.pair_partner(pair, "b") == "a"
    assert bounded.pair_partner(four, "a") is None and bounded.pair_partner(pair, "l") is None
    assert bounded.pair_partner([pair[0], pair[1], _member("b")], "a") is None  # (a name twice: no partner)
    assert bounded.pair_partner([pair[0], _member("a")], "a") is None
    for update in ({"norm_ratio": 0.0}, {"aggregator": "mean"}):
        assert RoundFormat(CONFIG.model_copy(update=update), ("w", "b"), SHAPES).halvings(merged, pair) == 0


def test_malformed_members_are_not_members():
    good = _member("a")
    gathered = {i: m for i, m in enumerate([good, None, {**good, "weight": -1.0}, {**good, "weight": float("inf")},
                                             {**good, "version": "1"}, {**good, "island": 3}])}
    assert RoundFormat.members(gathered) == [good]


def test_rda_keeps_embeddings_on_the_plain_mean():
    fmt = RoundFormat(CONFIG.model_copy(update={"merge": "rda"}), ("embed_tokens.weight", "w"), SHAPES)
    assert fmt.rda == [False, True]
    assert fmt.offsets == [wire.wire_offset(CONFIG.max_delta), wire.wire_offset(1.0)]


def test_a_failed_all_reduce_frees_its_tensors_without_the_cyclic_gc():
    """hivemind's future keeps the exception, whose traceback holds the caller's frames (the snapshot,
    the pseudo-gradient): the channel clears it, or the island's memory grew with every failed round."""
    import gc
    import weakref

    from p2p_diloco.net.channel import HivemindChannel

    class FailedControl:  # like hivemind's MPFuture after a failed round: it keeps one exception and raises it
        exception = RuntimeError("could not find a group")

        def result(self, timeout=None):
            raise self.exception

        def done(self):
            return True

    class AveragerDouble:
        client_mode = False

        def is_alive(self):
            return True

        def step(self, **kwargs):
            return FailedControl()

    channel = object.__new__(HivemindChannel)
    channel.averager, channel.allreduce_timeout, channel.levels = AveragerDouble(), 1.0, 0
    channel._traffic = torch.zeros(3, dtype=torch.int64)
    channel._shared = {"grid": torch.zeros(1, dtype=torch.int16), "failed_mask": torch.zeros(10, dtype=torch.uint8)}

    def a_round():
        payload = torch.zeros(1000)
        ref = weakref.ref(payload)
        assert channel.all_reduce(gather={}, weight=1.0, scheduled_time=time.time(), deadline=time.time() + 1,
                                  stop=threading.Event()) is None
        return ref

    gc.collect()
    gc.disable()
    try:
        assert a_round()() is None
    finally:
        gc.enable()


def test_a_client_offers_the_end_of_its_grace_window_as_its_expiration():
    """A client-mode member can only join a full member's group, whose leader refuses requests that
    expire before its own declared expiration (docs/DESIGN.md, "Islands behind NAT")."""
    from p2p_diloco.net.channel import HivemindChannel

    class AveragerDouble:
        def __init__(self, client_mode):
            self.client_mode, self.steps = client_mode, []

        def is_alive(self):
            return True

        def step(self, **kwargs):
            self.steps.append(kwargs)
            raise RuntimeError("no group")

    for client_mode, expected in ((False, 100.0), (True, 101.45)):
        channel = object.__new__(HivemindChannel)
        channel.averager, channel.allreduce_timeout, channel.levels = AveragerDouble(client_mode), 1.0, 0
        channel._traffic = torch.zeros(3, dtype=torch.int64)
        channel._shared = {"grid": torch.zeros(1, dtype=torch.int16)}
        channel._certificate = {}
        assert channel.all_reduce(gather={}, weight=1.0, scheduled_time=100.0, deadline=101.5,
                                  stop=threading.Event()) is None
        assert channel.averager.steps[0]["scheduled_time"] == expected


def test_the_channel_hands_hivemind_swarm_times_and_the_offset_its_averager_reads():
    """The averager process runs on swarm time (docs/DESIGN.md, "Clocks"); hivemind's step() adds its
    timeout to this machine's clock, so the timeout must land the deadline on the swarm-time one."""
    from p2p_diloco.algo.clock import ClockEstimate, SwarmClock
    from p2p_diloco.net.channel import HivemindChannel

    class AveragerDouble:
        client_mode, steps = False, []

        def is_alive(self):
            return True

        def step(self, **kwargs):
            self.steps.append(kwargs | {"now": time.time()})
            raise RuntimeError("no group")

    for offset in (2.0, -2.0):  # this machine's clock 2 s ahead of the swarm's, then 2 s behind
        clock = SwarmClock()
        clock.update(ClockEstimate(offset, 3, 0.001))
        channel = object.__new__(HivemindChannel)
        channel.averager, channel.allreduce_timeout, channel.levels = AveragerDouble(), 1.0, 0
        channel.clock, channel._clock_offset = clock, torch.zeros(1, dtype=torch.float64)
        channel._traffic = torch.zeros(3, dtype=torch.int64)
        channel._shared = {"grid": torch.zeros(1, dtype=torch.int16)}
        channel._certificate = {}
        slot = clock.now() + 3.0
        assert channel.all_reduce(gather={}, weight=1.0, scheduled_time=slot, deadline=slot + 1.5,
                                  stop=threading.Event()) is None
        step = channel.averager.steps[-1]
        assert step["scheduled_time"] == slot and float(channel._clock_offset[0]) == offset
        assert step["now"] + step["timeout"] == pytest.approx(slot + 1.5, abs=0.01)


def test_the_store_hands_over_and_publishes_together():
    store = FragmentStore([SHAPES])
    store.initialize([_params(0)])
    seen = []
    store.on_publish(lambda p, state: seen.append(state.version))
    new = FragmentState(_params(1), _params(2), 5, "h")
    learner = LearnerDouble(_params(0))
    store.hand_over(0, new, "update", learner)
    assert store.versions == [5] and learner.updates == ["update"] and seen == [0, 5]
    states = store.consistent_states(lambda: seen.append("applied"))
    assert states == [new] and seen[-1] == "applied"
    with pytest.raises(ValueError, match="hash"):
        store.restore([FragmentState(new.theta, new.momentum, 5, "wrong")])
