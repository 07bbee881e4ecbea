"""A lone island, islands of different speeds, and an island whose helper process dies."""

from __future__ import annotations

import os
import signal
import statistics

import pytest

from p2p_diloco.lab.localswarm import LocalSwarm
from p2p_diloco.procs import children
from tests.integration.helpers import FAST, events_of, rounds_by_slot, wait_for

pytestmark = pytest.mark.integration


def test_a_lone_island_and_one_joining_through_it_fall_back_below_their_quorum(tmp_path):
    """q0 starts alone (no initial peers), q1 joins through q0's address; a quorum of 3 is never met,
    so every round waits out its grace window, then carries the island's work into the next round
    (deferred, at most once in a row here) or steps on the island's own pseudo-gradient."""
    swarm = LocalSwarm(tmp_path, run_id="quorum")
    # a round every 3 s (2 fragments, T_outer 6 s; a round's 1.2 + 0.9 + 0.8 s fit in it): 64 inner steps take 16 s on
    # a fast day here (4 steps/s), which holds each fragment's deferral and step with rounds to spare; with
    # T_outer 8 s they held 4 rounds in all and the last, fragment 1's step, was cancelled by the island's end
    quorum = ["--outer-quorum", "3", "--outer-grace-window", "0.9", "--outer-fallback-defer", "1", "--outer-period", "6",
              "--outer-matchmaking-time", "1.2", "--outer-allreduce-timeout", "0.8"]
    try:
        swarm.start_island("q0", *FAST, *quorum, "--max-steps", "64", "--data-shard-index", "0", initial_peers=[])
        start = wait_for(lambda: events_of(swarm.events_path("q0"), "start"), timeout=120, message="q0's start")[0]
        wait_for(lambda: events_of(swarm.events_path("q0"), "step"), timeout=60, message="q0 training")
        swarm.start_island("q1", *FAST, *quorum, "--max-steps", "48", "--data-shard-index", "1",
                           initial_peers=start["maddrs"])
        assert swarm.wait_islands(180) == {"q0": 0, "q1": 0}
    finally:
        assert not swarm.close(), "processes had to be force-killed"
    summary = swarm.summary("q0")
    assert summary["eval_loss_last"] < summary["eval_loss_first"] - 1.0
    assert min(summary["fragment_versions"]) >= 1
    assert len(events_of(swarm.events_path("q1"), "join")) == 2  # q1 loaded q0's state of both fragments
    for name in ("q0", "q1"):
        rounds = [e for e in events_of(swarm.events_path(name), "round") if e["outcome"] in ("ok", "fallback")]
        assert len(rounds) >= 3 and all(e["outcome"] == "fallback" for e in rounds)
        assert swarm.summary(name)["outer_rounds_failed"] == len(rounds)
        assert all(e["t_end"] - e["slot_time"] >= 0.9 for e in rounds)  # each waited out its grace window
        for fragment in (0, 1):
            deferred = [bool(e.get("deferred")) for e in rounds if e["fragment"] == fragment]
            assert (True, True) not in zip(deferred, deferred[1:]), (name, fragment, deferred)  # at most 1 in a row
            assert deferred[:1] in ([], [True]), (name, fragment, deferred)  # the first one is carried over
        # a deferred fallback leaves the state as it is; the next one is a real outer step on the
        # island's own pseudo-gradient, which covers both rounds' work
        assert all((e["new_version"], e["new_hash"]) == (e["base_version"], e["base_hash"]) if e.get("deferred")
                   else e["new_version"] == e["base_version"] + 1 and e["new_hash"] != e["base_hash"] for e in rounds)
        assert any(not e.get("deferred") for e in rounds)
    assert len([e for e in events_of(swarm.events_path("q0"), "round") if e["outcome"] == "fallback"]) >= 4


# the papers' options (docs/RESULTS.md): RDA merges, int4 outer gradients on the wire, one fragment
# (plain DiLoCo, a round every 4 s) and plain averaging (FedAvg)
OPTIONS = ["--outer-merge", "rda", "--outer-codec", "int4", "--outer-fragments", "1", "--outer-period", "4",
           "--outer-lr", "1.0", "--outer-momentum", "0"]


def test_islands_of_2x_speeds_meet_in_the_same_rounds_with_rda_and_int4(tmp_path):
    swarm = LocalSwarm(tmp_path, run_id="speeds")
    try:
        swarm.start_bootstrap()
        # as many seconds of training each: the slower island takes half the steps
        # (about 30 s: 7 rounds, of which a loaded machine may lose the first or last to start-up skew)
        swarm.start_island("fast", *FAST, *OPTIONS, "--max-steps", "120", "--data-shard-index", "0")
        swarm.start_island("slow", *FAST, *OPTIONS, "--max-steps", "60", "--data-shard-index", "1", "--slowdown", "2")
        assert swarm.wait_islands(240) == {"fast": 0, "slow": 0}
    finally:
        assert not swarm.close(), "processes had to be force-killed"
    fast, slow = swarm.summary("fast"), swarm.summary("slow")
    step = {name: statistics.median(e["dt"] for e in events_of(swarm.events_path(name), "step")) for name in ("fast", "slow")}
    assert step["slow"] > 1.5 * step["fast"], step
    both = [by for by in rounds_by_slot({n: swarm.events_path(n) for n in ("fast", "slow")}).values()
            if set(by) == {"fast", "slow"}]
    shared = [by for by in both if all(e["outcome"] == "ok" and e["members"] == ["fast", "slow"] for e in by.values())]
    assert len(shared) >= 5 and len(shared) >= 0.7 * len(both), (len(shared), len(both))
    # the slower island brings fewer tokens per round and weighs less
    assert sum(by["slow"]["weight"] for by in shared) < sum(by["fast"]["weight"] for by in shared)
    # members that started from the same Theta and saw the same failed parts end identical
    same = [by for by in shared if all(e["canonical"] for e in by.values()) and by["fast"]["unaveraged"] == by["slow"]["unaveraged"]]
    assert len(same) >= 3 and all(by["fast"]["new_hash"] == by["slow"]["new_hash"] for by in same)
    for name, summary in (("fast", fast), ("slow", slow)):
        fp32 = 2 * summary["parameters"] * 4 / 2  # a round of two over fp32: half the model out, its average back
        for e in (by[name] for by in shared):  # 4 bits out, 5 to 7 back (docs/RESULTS.md, E5)
            assert 0 < e["bytes_sent"] <= fp32 / 5 and 0 < e["bytes_received"] <= fp32 / 5, (e, fp32)
        assert summary["eval_loss_last"] < summary["eval_loss_first"] - 1.0
        assert summary["reduction_vs_dp"] == pytest.approx(summary["dp_bytes_per_token"] / summary["bytes_per_token"],
                                                           rel=0.01)
        log = (swarm.workdir / f"{name}.log").read_text()
        assert "bandwidth:" in log and "fewer" in log and "terminate called" not in log  # a clean end


def test_an_island_whose_helper_process_dies_stops_with_an_error(tmp_path):
    swarm = LocalSwarm(tmp_path, run_id="helper")
    try:
        island = swarm.start_island("solo", *FAST, initial_peers=[])
        wait_for(lambda: events_of(swarm.events_path("solo"), "step"), timeout=120, message="training")
        forked = sorted(children(island.pid))
        os.kill(forked[0], signal.SIGKILL)  # the DHT process, forked first
        assert island.popen.wait(60) == 1
    finally:
        swarm.close()
    assert "died" in island.log_path.read_text()
    assert swarm.summary("solo")["stop_reason"] == "helper_died"
