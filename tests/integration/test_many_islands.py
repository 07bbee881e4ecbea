"""Sixteen lightweight islands on 127.0.0.1 in two groups that take turns (issue 18; docs/SCALE.md,
"Many islands on one machine"; docs/DESIGN.md, "Groups that take turns"): the product's islands with
the lab's synthetic learner, so that 16 of them fit 2 cores, 12 of them as client-mode members (as
islands behind NAT are: their DHT nodes store and serve nothing)."""

from __future__ import annotations

import collections

import pytest

from p2p_diloco.lab.scale import measure, parse_args
from p2p_diloco.procs import StopSignal
from tests.integration.helpers import rounds_by_slot

pytestmark = pytest.mark.integration


def test_sixteen_islands_in_two_groups_take_turns_and_every_slot_steps_the_one_global_state(tmp_path):
    # a slot every 6 s (one fragment, 2 groups: each island's every 12 s), 2 periods (4 slots) measured
    # once all 16 train (about 40 s of start-up here); a micro model (34k parameters) keeps the rounds'
    # bandwidth from filling the time between slots on a loaded machine: this test is about the
    # swarm's mechanics, docs/SCALE.md measures the bandwidth
    args = parse_args(["--islands", "16", "--client-islands", "12", "--groups", "2", "--rounds", "2",
                       "--period", "12", "--hidden-size", "16", "--layers", "1", "--step-s", "0.5",
                       "--matchmaking-time", "2", "--progress-period", "4", "--start-timeout", "300"])
    row = measure(16, args, tmp_path, StopSignal())
    assert not row["leftover_processes"], "processes had to be force-killed"
    assert row["records_seen"]["max"] == 16  # an observer sees every island's progress record
    outcomes = row["outcomes"]
    assert outcomes.get("ok", 0) >= 0.75 * sum(outcomes.values()), outcomes
    assert row["group_size"]["median"] >= 6, row["group_size"]
    start, end = row["window"]
    names = sorted(f"island-{i}" for i in range(16))
    by_slot = rounds_by_slot({path.name.split(".")[0]: path for path in (tmp_path / "n16").glob("*.events.jsonl")})
    ok = {slot: {name: e for name, e in rounds.items() if e["outcome"] == "ok"} for slot, rounds in by_slot.items()}
    ok = {slot: rounds for slot, rounds in ok.items() if rounds}  # (the swarm's close leaves slots of none)
    window = [slot for slot in sorted(ok) if start <= min(e["slot_time"] for e in ok[slot].values()) < end]
    assert len(window) >= 4, window
    # every ok round of a slot ends at one version, the next after the group's newest base (a member
    # that missed the other group's round joins from its older base and takes the round's result:
    # docs/DESIGN.md, "Joining, lagging and forks")
    for slot, rounds in ok.items():
        newest = max(e["base_version"] for e in rounds.values())
        assert {e["new_version"] for e in rounds.values()} == {newest + 1}, (slot, rounds)
    majority = {slot: collections.Counter((e["new_version"], e["new_hash"]) for e in rounds.values()).most_common(1)[0]
                for slot, rounds in ok.items()}
    for slot in window:
        rounds = ok[slot]
        # only the slot's group took it: the islands at even places of the sorted names the even
        # slots, the others the odd ones
        assert {names.index(name) % 2 for name in rounds} == {slot[1] % 2}, (slot, sorted(rounds))
        # one state holds a strict majority of the slot's ok rounds, and it steps the state the other
        # group's slot before made (which the members reloaded before their turn): one global state
        assert 2 * majority[slot][1] > len(rounds), (slot, rounds)
        before = (slot[0], slot[1] - 1)
        if before in window:
            bases = collections.Counter((e["base_version"], e["base_hash"]) for e in rounds.values())
            assert bases.most_common(1)[0][0] == majority[before][0], (slot, bases, majority[before])
            assert majority[slot][0][0] == majority[before][0][0] + 1
        # a member left on another state ends its next ok round on that round's majority state: forks
        # heal, they never persist
        for name, e in rounds.items():
            later = [s for s in sorted(ok) if s[0] == slot[0] and s > slot and name in ok[s]]
            if (e["new_version"], e["new_hash"]) != majority[slot][0] and later:
                mine = ok[later[0]][name]
                assert (mine["new_version"], mine["new_hash"]) == majority[later[0]][0], (name, slot, later[0])
