"""Rounds through real hivemind averagers, in this test process (as hivemind's own averaging tests
run): three DHTs on 127.0.0.1, one :class:`HivemindChannel` per member and test, and the product's
syncer parts wired as an island wires them. A round takes a few seconds; these check what a group
does: members end bit-identical (plain, low-bit and RDA rounds), a fork reloads, a member sending
garbage or lying is rejected and flagged, a reducer that stalls leaves a part unaveraged, and a
listener keeps its progress."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import threading
import time
import uuid

import numpy as np
import pytest
import torch

from p2p_diloco.algo import grid, outer
from p2p_diloco.algo.schedule import RoundSlot
from p2p_diloco.config import OuterConfig
from p2p_diloco.island.contribution import WEIGHT_UNIT
from p2p_diloco.lab.faults import AttackingFormat, CorruptingFormat, Garbage, LyingReducerFormat
from p2p_diloco.net.channel import HivemindChannel
from p2p_diloco.net.dht import start_dht, visible_maddrs
from tests.doubles import IslandParts

pytestmark = pytest.mark.integration

# hivemind gives each member of a group whole tensors (parts) to reduce: with three near-equal tensors
# (and a small one), every member of a group of 3 reduces one
NAMES = ("w1", "w2", "w3", "b")
SHAPES = [torch.Size([24, 32]), torch.Size([768]), torch.Size([32, 24]), torch.Size([64])]
NUMEL = sum(shape.numel() for shape in SHAPES)
CONFIG = OuterConfig(period=10.0, fragments=1, matchmaking_time=2.0, grace_window=0.5, allreduce_timeout=3.0,
                     request_timeout=0.5)


def member(name, dht, prefix, theta, local, config=CONFIG, **kwargs) -> IslandParts:
    """One island's syncer over a real channel, serving its state to downloaders."""

    def open_channel(parts: IslandParts) -> HivemindChannel:
        return HivemindChannel(dht, shapes=SHAPES, codec=config.codec, ceilings=parts.wire.ceilings,
                               state_provider=lambda: parts.transfer.donate(0), allreduce_timeout=config.allreduce_timeout,
                               prefix=prefix, quorum=2, matchmaking_time=config.matchmaking_time / 2,
                               request_timeout=config.request_timeout, merge_rule=parts.wire.merge_rule)

    member = IslandParts(name, theta, local, shapes=SHAPES, names=NAMES, config=config, open_channel=open_channel,
                         **kwargs)
    member.channel.share_state()
    return member


@pytest.fixture
def group():
    """make(local params per member, theta or one theta per member, names=..., wires=..., stall=...,
    **member kwargs) -> members, each on a DHT of its own (joined to the first), under a group key of
    their own. They end as islands end: the DHTs first, then the averagers (HivemindChannel.close)."""
    from hivemind.utils.mpfuture import MPFuture

    dhts, made = [], []

    def make(locals_, theta, names="abc", wires=(), stall=(), **kwargs):
        prefix = f"t{uuid.uuid4().hex[:8]}"
        thetas = theta if isinstance(theta[0], list) else [theta] * len(locals_)
        wires = list(wires) + [None] * (len(locals_) - len(wires))
        members = []
        for name, start, local, wire in zip(names, thetas, locals_, wires):
            peers = visible_maddrs(dhts[0]) if dhts else []
            dhts.append(start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], wait_timeout=1.0))
            with stalled_reducer() if name in stall else contextlib.nullcontext():
                members.append(member(name, dhts[-1], prefix, start, local, wire=wire, **kwargs))
            made.append(members[-1])
        return members

    yield make
    for island in made:
        island.stop.set()
    for dht in dhts:
        dht.shutdown()
    for island in made:
        island.channel.close()
    # an averager ended mid-message would leave hivemind's cross-process update lock taken in every
    # process forked later: the next test's processes get fresh locks
    MPFuture.reset_backend()


@contextlib.contextmanager
def stalled_reducer():
    """An averager forked meanwhile never answers the parts it is to reduce (a member that freezes
    mid-round): the others keep their own values for its part of the fragment."""
    from hivemind.averaging.allreduce import AllReduceRunner

    async def never_answer(self, stream, context):
        await asyncio.sleep(3600)
        yield None

    original = AllReduceRunner.rpc_aggregate_part
    AllReduceRunner.rpc_aggregate_part = never_answer
    try:
        yield
    finally:
        AllReduceRunner.rpc_aggregate_part = original


def run_round(*members, lead=2.5):
    """Every member's syncer runs the same slot, in parallel, as islands do."""
    slot = RoundSlot(time.time() + lead, 0, 7)
    threads = [threading.Thread(target=m.syncer._run_round, args=(0, slot)) for m in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "a round did not end within 30 s"
    return [m.last for m in members]


def nesterov_step(theta, merged, momentum=None):
    expected = [t.clone() for t in theta]
    outer.outer_step(expected, merged, momentum or [torch.zeros_like(t) for t in theta], lr=0.7, momentum=0.9,
                     nesterov=True)
    return expected


def _params(seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * scale for shape in SHAPES]


def _moved(theta, seed, scale):
    return [t - scale * g for t, g in zip(theta, _params(seed))]


def test_members_with_the_same_base_end_identical_at_the_nesterov_step_of_the_mean(group):
    theta = _params(0)
    a, b = group([_moved(theta, 1, 0.01), _moved(theta, 2, 0.02)], theta)
    events = run_round(a, b)
    assert [e["outcome"] for e in events] == ["ok", "ok"] and events[0]["members"] == ["a", "b"]
    assert a.store.hashes == b.store.hashes and a.store.versions == b.store.versions == [1]
    assert events[0]["pair_against"] is events[1]["pair_against"] is False
    for e in events:  # the group formed (the all-reduce began) at the slot and before it returned
        assert e["slot_time"] - 0.5 <= e["t_formed"] <= e["t_merged"], e
    merged = outer.weighted_mean([outer.pseudo_gradient(theta, m.learner.params) for m in (a, b)], [1.0, 1.0])
    for got, want in zip(a.theta, nesterov_step(theta, merged)):  # equal tokens and steps: equal weights
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert events[0]["weight"] == outer.token_weight(4096, 2) / WEIGHT_UNIT
    assert a.stats.rounds_ok == 1 and a.stats.group_sizes == [2]
    assert a.stats.bytes_sent == a.stats.round_bytes_sent == events[0]["bytes_sent"] > 0
    (update,) = a.learner.updates
    assert update.mode == "carry" and update.version == 1


def test_token_weights_decide_the_mean_up_to_the_cap(group):
    theta = _params(0)
    a, b = group([_moved(theta, 1, 0.01), _moved(theta, 2, 0.02)], theta)
    b.learner.tokens, b.learner.steps = 3 * 4096, 2  # 9x a's weight (tokens^2 / steps)
    run_round(a, b)
    # capped at 1.5x the lower median weight (a's 1): 1.5 (docs/SECURITY.md)
    merged = outer.weighted_mean([outer.pseudo_gradient(theta, m.learner.params) for m in (a, b)], [1.0, 1.5])
    for got, want in zip(b.theta, nesterov_step(theta, merged)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert a.store.hashes == b.store.hashes


def test_a_listener_and_a_contributor_end_identical(group):
    """A member with nothing to contribute weighs 1e-12: the contributor's result rounds back to
    exactly what it sent, which must not be taken for a failed part."""
    theta = _params(0)
    a, b = group([_moved(theta, 1, 0.01), theta], theta)
    b.learner.tokens = b.learner.steps = 0
    events = run_round(a, b)
    assert [e["outcome"] for e in events] == ["ok", "ok"] and [e["unaveraged"] for e in events] == [0.0, 0.0]
    assert a.store.hashes == b.store.hashes


def test_a_member_on_a_fork_reloads_the_result_its_canonical_partner_records(group):
    theta = _params(0)
    fork = [t + 1e-3 for t in theta]
    a, b = group([[t - 0.01 for t in theta], [t - 0.02 for t in fork]], [theta, fork])
    a.syncer.rounds[0].records = lambda: [("b", b.store.versions, b.store.hashes)]
    b.syncer.rounds[0].records = lambda: [("a", a.store.versions, a.store.hashes)]
    events = run_round(a, b)
    (winner, loser) = (a, b) if events[0]["canonical"] else (b, a)
    lost = loser.last
    assert lost["canonical"] is False and lost["reloaded"] is True and lost["outcome"] == "ok"
    assert loser.store.hashes == winner.store.hashes and loser.store.versions == winner.store.versions == [1]
    assert loser.stats.reloads == 1 and any(e["event"] == "donate" for e in winner.events)


def test_a_member_on_a_fork_takes_no_donors_word_for_the_result(group):
    """Without the canonical member's record of the result's hash, the member that was on a fork
    keeps its own step (a fork the base repair heals later) rather than whatever a donor serves at
    that version or newer: the first donor to answer may hold a fork of its own (docs/SECURITY.md)."""
    theta = _params(0)
    fork = [t + 1e-3 for t in theta]
    a, b = group([[t - 0.01 for t in theta], [t - 0.02 for t in fork]], [theta, fork])
    events = run_round(a, b)
    (winner, loser) = (a, b) if events[0]["canonical"] else (b, a)
    assert loser.last["canonical"] is False and loser.last["reloaded"] is False and loser.last["outcome"] == "ok"
    assert loser.store.versions == winner.store.versions == [1] and loser.store.hashes != winner.store.hashes
    assert loser.stats.reloads == 0
    # a record of another hash at that version (a member's lie, or a fork of its own) is not taken either
    loser.syncer.rounds[0].records = lambda: [(winner.name, [1], ["0" * 16])]
    assert loser.syncer.rounds[0]._reload_result(0, {winner.name}, 1) is None and loser.stats.reloads == 0


def test_a_member_on_a_fork_asks_the_donors_whose_records_show_the_result(group):
    """A member that missed a round's result downloads it from the donors whose records show its hash,
    by peer id: hivemind's own download asks the donor of the highest declared priority first, and
    one that declares the highest and serves a fork of its own (x) would keep it from the result."""
    theta = _params(0)
    a, b, x = group([[t - 0.01 for t in theta], [t - 0.02 for t in theta], theta], theta, names="abx")
    a.store.publish(0, a.store.states[0].stepped(_params(1, 0.01), 1, 1, lr=0.7, momentum=0.9, nesterov=True))
    x.store.publish(0, x.store.states[0].stepped(_params(2, 0.01), 2, 1, lr=0.7, momentum=0.9, nesterov=True))
    x.channel.set_donor_priority(1e6)  # asked first by hivemind, and it serves another state of version 2
    records = {m.name: lambda m=m: (m.channel.averager.peer_id.to_base58(), m.store.versions, m.store.hashes)
               for m in (a, x)}
    b.syncer.rounds[0].records = lambda: [(name, *record()[1:]) for name, record in records.items()]
    b.transfer.holders = lambda: [record() for record in records.values()]

    def declared():  # x's declaration has reached the DHT: hivemind's download would ask x first
        found = a.channel.averager.dht.get(f"{x.channel.averager.prefix}.all_averagers", latest=True)
        return found is not None and any(getattr(entry, "value", None) == 1e6 for entry in found.value.values())

    deadline = time.monotonic() + 15
    while not declared():
        assert time.monotonic() < deadline, "x's donor declaration never reached the DHT"
        time.sleep(0.2)
    events = run_round(a, b)
    assert [e["canonical"] for e in events] == [True, False] and b.last["reloaded"] is True
    assert b.store.versions == a.store.versions == [2] and b.store.hashes == a.store.hashes != x.store.hashes
    assert not [e for e in x.events if e["event"] == "donate"]  # never asked


@pytest.mark.parametrize("garbage", ["nan", "huge"])  # (inf takes nan's path: tests/unit/test_syncer.py)
def test_a_member_sending_garbage_is_rejected_flagged_and_avoided(group, garbage):
    theta = _params(0)
    faulty = CorruptingFormat(CONFIG, NAMES, SHAPES, garbage=Garbage(garbage, True))
    a, b, x = group([_moved(theta, i, 0.01) for i in (1, 2, 3)], theta, names="abx", wires=[None, None, faulty])
    events = run_round(a, b, x)
    assert [e["outcome"] for e in events] == ["rejected"] * 3
    assert events[0]["culprits"] == events[1]["culprits"] == ["x"] and events[2]["culprits"] == []  # it blames nobody
    for honest in (a, b):
        assert honest.store.versions == [0] and honest.store.hashes == [outer.tensors_hash(theta)]  # nothing applied
        assert not honest.learner.updates and "x" in honest.quarantine and honest.stats.rounds_rejected == 1
    if garbage == "nan":  # the next round: the honest islands meet under a group key x does not use
        events = run_round(a, b, x)
        assert [e["outcome"] for e in events] == ["ok", "ok", "fallback"] and events[0]["members"] == ["a", "b"]


def test_an_attacker_within_the_bounds_is_clipped_then_flagged_and_members_stay_identical(group):
    """One member sends its update reversed at the bound and claims a million times its weight: every
    value passes the checks, so the round is ok, but the weight cap and CenteredClip keep the result
    near the honest members' mean, the reducers see the attacker far out, and it is flagged."""
    config = CONFIG.model_copy(update={"outlier_rounds": 1})  # flagged at the first such round
    theta = _params(0)
    attacker = AttackingFormat(config, NAMES, SHAPES, attacks=["flip", "inflate"])
    local = [_moved(theta, i, 0.01) for i in (1, 2, 3)]
    a, b, x = group(local, theta, names="abx", wires=[None, None, attacker], config=config)
    events = run_round(a, b, x)
    # (the attacker itself does not apply the result: it points against the reversed update it sent)
    assert [e["outcome"] for e in events] == ["ok", "ok", "rejected"] and events[0]["members"] == ["a", "b", "x"]
    assert events[2]["vetoed"] and a.store.hashes == b.store.hashes  # one reducer per part: the same bits
    assert events[0]["outliers"] == events[1]["outliers"] == ["x"] and "x" in a.quarantine and "x" in b.quarantine
    assert events[0]["suspect_reducers"] == events[1]["suspect_reducers"] == []  # it reduced honestly
    assert a.quarantine.flagged_reasons() == {"x": "outlier"}
    deltas = [outer.pseudo_gradient(theta, m) for m in local]
    honest = outer.weighted_mean(deltas[:2], [1.0, 1.0])
    flipped = [-torch.sign(d) for d in deltas[2]]
    capped_mean = outer.weighted_mean([*deltas[:2], flipped], [1.0, 1.0, 1.5])  # the cap alone: 1.5x the median
    applied = outer.pseudo_gradient(theta, a.theta)  # = -(lr * Nesterov) of the merged update, first step
    want, plain = nesterov_step(theta, honest), nesterov_step(theta, capped_mean)
    error = sum(float((t - w).norm()) for t, w in zip(a.theta, want))
    assert error < 0.1 * sum(float((p - w).norm()) for p, w in zip(plain, want)), applied
    # the next round, the honest members meet without it
    events = run_round(a, b, x)
    assert [e["outcome"] for e in events] == ["ok", "ok", "fallback"] and events[0]["members"] == ["a", "b"]


def test_a_pair_round_with_an_attacker_is_vetoed_by_the_honest_member_and_halved_for_the_others(group):
    """Of 2 contributors nothing tells the attacker apart, but its reversed update at the bound makes
    the merged update point against the honest one: the honest member does not apply it (its state
    and progress wait for its next round) and notes one round of evidence; the others halve it until
    it is at most 2x the shorter reported update (exact: they stay identical), and nobody is flagged
    for it yet."""
    theta = _params(0)
    attacker = AttackingFormat(CONFIG, NAMES, SHAPES, attacks=["flip", "inflate"])
    local = [_moved(theta, 1, 0.01), _moved(theta, 1, 0.012), theta]  # (honest updates alike: it reverses a's)
    a, x, listener = group(local, theta, names="axl", wires=[None, attacker])
    listener.learner.tokens = listener.learner.steps = 0
    events = run_round(a, x, listener)
    assert [e["outcome"] for e in events] == ["rejected", "ok", "ok"] and events[0]["members"] == ["a", "l", "x"]
    assert events[0]["vetoed"] is True and "vetoed" not in events[1] and "vetoed" not in events[2]
    assert a.store.versions == [0] and a.store.hashes == [outer.tensors_hash(theta)] and not a.learner.updates
    print("halved", events[2]["halvings"], "times")
    assert events[1]["halvings"] == events[2]["halvings"] >= 4
    assert x.store.hashes == listener.store.hashes != a.store.hashes and "x" not in a.quarantine
    # the honest member sees the merged update point against its own: one round of evidence (3 of 5 flag)
    assert events[0]["pair_against"] is True and "pair_against" not in events[2]  # (a listener has none)
    honest = outer.pseudo_gradient(theta, local[0])
    flipped = [-torch.sign(d) for d in outer.pseudo_gradient(theta, local[1])]
    want = [m * 2.0 ** -events[2]["halvings"] for m in outer.weighted_mean([honest, flipped], [1.0, 1.5])]
    for got, expected in zip(listener.theta, nesterov_step(theta, want)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    norm = math.sqrt(sum(float(t.norm()) ** 2 for t in want))
    assert norm <= 2 * math.sqrt(sum(float(t.norm()) ** 2 for t in honest))
    # its next round sends the progress of both rounds, with both rounds' tokens
    assert a.syncer.rounds[0].carried_tokens == a.learner.tokens


def test_a_reducer_that_returns_the_average_reversed_is_caught_by_the_members_it_lied_to(group):
    """A member sends its update honestly but returns every part it reduces reversed (within the
    bounds, the same to everyone): its share of the result points against the outer momentum that
    every member of the base holds, while the other reducers' shares point along it, so every member
    (itself included) leaves that share out alike and they end on one state; the others also see
    it disagree with what they sent, and flag it."""
    config = CONFIG.model_copy(update={"outlier_rounds": 1})
    theta = _params(0)
    liar = LyingReducerFormat(config, NAMES, SHAPES)
    a, b, x = group([_moved(theta, i, 0.01) for i in (1, 2, 3)], theta, names="abx", wires=[None, None, liar],
                    config=config)
    # earlier rounds' updates went where this round's mean goes (m_p, the same on every member)
    momentum = [sum(0.01 * g for g in gs) for gs in zip(*(_params(i) for i in (1, 2, 3)))]
    for m in (a, b, x):
        m.store.publish(0, dataclasses.replace(m.store.states[0], momentum=[t.clone() for t in momentum]))
    events = run_round(a, b, x)
    assert [e["outcome"] for e in events] == ["ok"] * 3 and a.store.hashes == b.store.hashes == x.store.hashes
    assert all(e["dropped_reducers"] == ["x"] for e in events), events
    share = events[0]["unaveraged"]  # its part, about a third of the fragment, the same bits for all
    assert 0.2 < share < 0.5 and events[1]["unaveraged"] == events[2]["unaveraged"] == share
    # the honest reducers' parts took the Nesterov step of the mean; x's part the step of a zero update
    want = outer.weighted_mean([outer.pseudo_gradient(theta, _moved(theta, i, 0.01)) for i in (1, 2, 3)], [1.0] * 3)
    stepped = nesterov_step(theta, want, [t.clone() for t in momentum])
    unmoved = nesterov_step(theta, [torch.zeros_like(t) for t in theta], [t.clone() for t in momentum])
    on_mean = [(got - s).abs() <= 1e-5 for got, s in zip(a.theta, stepped)]
    on_zero = [(got - u).abs() <= 1e-5 for got, u in zip(a.theta, unmoved)]
    assert all(bool((m | z).all()) for m, z in zip(on_mean, on_zero))
    assert sum(int((z & ~m).sum()) for m, z in zip(on_mean, on_zero)) == pytest.approx(share * NUMEL, abs=1)
    assert events[0]["suspect_reducers"] == events[1]["suspect_reducers"] == ["x"]
    assert events[0]["outliers"] == events[1]["outliers"] == []  # what it sent was honest
    assert a.quarantine.flagged_reasons() == b.quarantine.flagged_reasons() == {"x": "reducer"}


@pytest.mark.parametrize("lie", [
    {"delta_max": float("inf")},
    {"norms": [1e300, 1e300]},  # no clipped pseudo-gradient is that long
    {"exponents": np.full(grid.num_chunks(SHAPES), 30, "<i2").tobytes()},  # a grid far coarser than needed
])
def test_a_member_lying_in_its_metadata_gets_the_round_rejected_and_is_flagged(group, lie):
    config = CONFIG.model_copy(update={"codec": "int4", "merge": "rda"})
    theta = _params(0)
    a, b = group([_moved(theta, 1, 0.01), _moved(theta, 2, 0.02)], theta, config=config)
    honest = b.channel.all_reduce
    b.channel.all_reduce = lambda *, gather, **kwargs: honest(gather=gather | lie, **kwargs)
    events = run_round(a, b)
    assert events[0]["outcome"] == "rejected" and events[0]["culprits"] == ["b"]
    assert "b" in a.quarantine and a.store.versions == [0] and not a.learner.updates


@pytest.mark.parametrize("codec,merge", [("int4", "mean"), ("none", "rda"), ("int4", "rda")])  # (all codecs: test_wire)
def test_compressed_and_rda_rounds_keep_members_identical_and_errors_local(group, codec, merge):
    config = CONFIG.model_copy(update={"codec": codec, "merge": merge})
    theta = _params(0)
    a, b = group([_moved(theta, 1, 0.01), _moved(theta, 2, 0.03)], theta, config=config)
    events = run_round(a, b)
    assert [e["outcome"] for e in events] == ["ok", "ok"] and a.store.hashes == b.store.hashes  # bit-identical
    deltas = [outer.pseudo_gradient(theta, m.learner.params) for m in (a, b)]
    expected = (outer.rda_mean if merge == "rda" else outer.weighted_mean)(deltas, [1.0, 1.0])
    merged = [(t - new) / (0.7 * 1.9) for t, new in zip(theta, a.theta)]  # the first Nesterov step: lr (1 + m)
    levels = grid.LEVELS.get(codec, 0)
    for j, (got, want) in enumerate(zip(merged, expected)):  # within half a grid step of the exact merge
        largest = max(float(d[j].abs().max()) for d in deltas)
        tolerance = 1e-5 if not levels else largest * (1.0 / levels + 0.05) * (2 if merge == "rda" else 1)
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance)
    # what was not sent stays local: carry = Theta_new - (snapshot + residual), |residual| <= half a step
    for member in (a, b):
        update = member.learner.updates[-1]
        assert update.mode == "carry"
        residual = [new - carry - snap for new, carry, snap in zip(a.theta, update.tensors, member.learner.params)]
        for j, r in enumerate(residual):  # the grid's step fits the larger member's values
            largest = max(float(d[j].abs().max()) for d in deltas)
            assert float(r.abs().max()) <= (largest / levels if levels else 1e-6) * 1.001 + 1e-6
        if levels:
            assert any(float(r.abs().max()) > 0 for r in residual)  # quantization error kept for next time
    if codec == "int4":  # 4 bits out, 5-7 back: far fewer bytes than fp32's 4 bytes each way
        assert 0 < events[0]["bytes_sent"] < NUMEL * 4 / 4


def test_a_part_no_reducer_averaged_gets_no_outer_update_and_keeps_the_local_progress(group):
    theta = _params(0)
    a, b, c = group([_moved(theta, i, 0.01 * i) for i in (1, 2, 3)], theta, stall="c")
    events = run_round(a, b, c)
    assert [e["outcome"] for e in events[:2]] == ["ok", "ok"] and events[0]["members"] == ["a", "b", "c"]
    share = events[0]["unaveraged"]
    assert share in (768 / NUMEL, 832 / NUMEL) and events[1]["unaveraged"] == share  # the stalled member's part
    assert a.store.hashes == b.store.hashes  # the same Theta on both members that saw the failure
    mean = outer.weighted_mean([outer.pseudo_gradient(theta, m.learner.params) for m in (a, b, c)], [1.0] * 3)
    stepped = nesterov_step(theta, mean)
    flat = torch.cat([t.reshape(-1) for t in a.theta])
    unmoved = flat == torch.cat([t.reshape(-1) for t in theta])  # a zero merged pseudo-gradient there
    assert int(unmoved.sum()) == round(share * NUMEL)
    torch.testing.assert_close(flat[~unmoved], torch.cat([t.reshape(-1) for t in stepped])[~unmoved], rtol=0, atol=1e-5)
    # where nobody averaged, the progress is measured from the old Theta (= Theta_new there): the carry
    # adds nothing (up to the rounding of snapshot + Delta) and the island keeps all of its local progress
    carry = torch.cat([t.reshape(-1) for t in a.learner.updates[-1].tensors])
    torch.testing.assert_close(carry[unmoved], torch.zeros(int(unmoved.sum())), rtol=0, atol=1e-6)


def test_a_listener_keeps_its_whole_pseudo_gradient_for_later(group):
    config = CONFIG.model_copy(update={"codec": "int4"})
    theta = _params(0)
    a, b = group([_moved(theta, 1, 0.01), _moved(theta, 2, 0.02)], theta, config=config)
    a.learner.tokens = a.learner.steps = 0
    events = run_round(a, b)
    assert events[0]["outcome"] == "ok" and events[0]["weight"] == 0.0
    update = a.learner.updates[-1]
    base = [new - carry for new, carry in zip(a.theta, update.tensors)]
    for got, want in zip(base, theta):  # base = snapshot + Delta = the old Theta: all local progress kept
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
