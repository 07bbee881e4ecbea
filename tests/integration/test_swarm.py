"""A bootstrap node and three islands started together on 127.0.0.1, and a late joiner that joins
through the restarted bootstrap node and is then SIGKILLed, while an island of another fingerprint
is refused.

The tests share one swarm (module fixture) and run in any order: the three islands stay up, the
bootstrap node keeps its address across its restart, and the late joiner is its test's own.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import statistics
import time

import pytest
import torch

from p2p_diloco.lab.localswarm import LocalSwarm
from p2p_diloco.procs import descendants, pid_alive
from tests.conftest import KEPT
from tests.integration.helpers import (FAST, PACED, assert_clean_error, cli_in_background, events_of, max_step_gap,
                                       rounds_by_slot, status_json, wait_for)

pytestmark = pytest.mark.integration
ISLANDS = ["island-0", "island-1", "island-2"]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    swarm = LocalSwarm(tmp_path_factory.mktemp("swarm"), run_id="itest")
    with socket.socket() as probe:  # a fixed port, so that a restarted bootstrap node keeps its address
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    swarm.bootstrap_flags = ["--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--summary-period", "1"]
    launched = time.time()
    swarm.start_bootstrap(*swarm.bootstrap_flags)
    for index, name in enumerate(ISLANDS):
        swarm.start_island(name, *FAST, *PACED, "--data-shard-index", str(index))

    def all_training():
        snapshot = status_json(swarm.initial_peers, swarm.run_id)
        names = {i["island"] for i in snapshot["islands"] if i["state"] == "training"}
        return time.time() if names == set(ISLANDS) else None

    swarm.visible_at = wait_for(all_training, timeout=120, message="3 training islands in `status --json`")
    up_at = max(events_of(path, "start")[0]["t"] for path in _paths(swarm).values())
    print(f"visible {swarm.visible_at - launched:.1f} s after launch, {swarm.visible_at - up_at:.1f} s after the "
          "last DHT came up")
    swarm.up_at = up_at
    yield swarm
    forced = swarm.close()
    KEPT.discard(swarm.bootstrap.pid)  # (a restarted bootstrap node's: its PID may be reused)
    assert not forced, "processes had to be force-killed"


def _paths(swarm, names=ISLANDS):
    return {name: swarm.events_path(name) for name in names}


def test_islands_see_each_other_within_30s(swarm):
    assert swarm.visible_at - swarm.up_at <= 30


def test_rounds_complete_with_two_or_more_members(swarm):
    def enough():
        ok = {name: [e for e in events_of(path, "round") if e["outcome"] == "ok" and e["group_size"] >= 2]
              for name, path in _paths(swarm).items()}
        return ok if all(len(rounds) >= 3 for rounds in ok.values()) else None

    ok = wait_for(enough, timeout=90, message="3 rounds of 2+ members on every island")
    assert any(e["group_size"] == 3 for rounds in ok.values() for e in rounds)


def test_members_of_a_shared_round_hold_identical_theta(swarm):
    def shared_rounds():
        shared = {}
        for key, by_island in rounds_by_slot(_paths(swarm)).items():
            # (a member whose parts partly did not arrive in time keeps its own values there, says so in
            # `unaveraged` and reloads the canonical Theta after the round: only whole averages must agree)
            canonical = {name: e for name, e in by_island.items()
                         if e["outcome"] == "ok" and e.get("canonical") and not e.get("unaveraged")}
            if len(canonical) >= 2:
                shared[key] = canonical
        return shared if len(shared) >= 3 else None

    shared = wait_for(shared_rounds, timeout=60, message="3 rounds whose members started from the same Theta")
    for (fragment, slot), members in shared.items():
        assert len({e["new_hash"] for e in members.values()}) == 1, (fragment, slot, members)
        assert len({e["new_version"] for e in members.values()}) == 1


def _start_another_fingerprint(swarm, tmp_path):
    """Start, in the background, an island of the tiny preset's own architecture saved as a model folder
    with other initial weights (its config's hash and its weights' both differ from the swarm's;
    tests/unit/test_models.py separates the two), through island-0's address."""
    from transformers import LlamaForCausalLM

    from p2p_diloco.island.model import PRESETS, llama_config

    torch.manual_seed(99)
    LlamaForCausalLM(llama_config(PRESETS["tiny"], 2048)).save_pretrained(tmp_path / "other_model")
    address = events_of(swarm.events_path("island-0"), "start")[0]["maddrs"][:1]
    return cli_in_background("peer", "--run-id", swarm.run_id, "--island", "other", *FAST, "--model",
                             str(tmp_path / "other_model"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                             "--initial-peers", *address, "--log-jsonl", str(tmp_path / "other.events.jsonl"))


def _restart_bootstrap(swarm) -> None:
    """Stop the bootstrap node as a service manager would and start it again (same key, same port):
    it has forgotten everyone until the islands, which ping their initial peers now and then, find it."""
    assert stat.S_IMODE(os.stat(swarm.workdir / "bootstrap.key").st_mode) == 0o600
    assert "peers connected; run itest: 3 islands" in swarm.bootstrap.log_path.read_text()  # its periodic summary
    swarm.bootstrap.remember_tree()
    tree = list(swarm.bootstrap.tree)
    assert tree, "the DHT process and p2pd run under the bootstrap node"
    address = list(swarm.initial_peers)
    assert swarm.bootstrap.stop(timeout=20) == 0
    assert not any(pid_alive(pid) for pid in tree)
    assert swarm.start_bootstrap(*swarm.bootstrap_flags) == address  # same identity file and port: same address
    KEPT.add(swarm.bootstrap.pid)  # the swarm's fixture ends it
    wait_for(lambda: "run itest: 3 islands" in swarm.bootstrap.log_path.read_text().rpartition("identity")[2],
             timeout=60, message="the islands to find the restarted bootstrap node")


def test_a_late_joiner_loads_the_state_through_a_restarted_bootstrap_contributes_then_dies_without_pausing_anyone(
        swarm, tmp_path):
    # meanwhile, an island of another fingerprint is refused and touches nothing (it starts while the
    # bootstrap node restarts)
    other = _start_another_fingerprint(swarm, tmp_path)
    _restart_bootstrap(swarm)  # the joiner knows only the bootstrap node's address
    joiner = swarm.start_island("late", *FAST, *PACED, "--data-shard-index", "3")
    path = swarm.events_path("late")

    def first_contribution():
        contributed = [e for e in events_of(path, "round") if e.get("contributed") and e["outcome"] == "ok"]
        return contributed[0] if contributed else None

    first = wait_for(first_contribution, timeout=120, message="the late joiner's first contributed round")
    joins = events_of(path, "join")
    # state came from peers, not the seed
    assert len(joins) == 2 and all(j["version"] > 0 for j in joins), swarm.islands["late"].log_path.read_text()[-3000:]
    # not stale; or, when it joined while the others' records still showed the version before a round
    # they were finishing (a joiner takes only the state the records vouch for, and a repair follows a
    # newer version only once 2 islands' records show it: docs/SECURITY.md), one version behind, and
    # then it reloads the round's result (once the records show its hash: right after the round, or
    # at its next base repair)
    assert first["group_size"] >= 2
    assert (first["canonical"] and first["base_version"] == first["group_max_version"]) or (
        first["base_version"] == first["group_max_version"] - 1), first
    if not first["canonical"] and not first.get("reloaded"):
        wait_for(lambda: [e for e in events_of(path, "reload") if e["t"] > first["t"] and e["reloaded"]
                          and e["fragment"] == first["fragment"]], timeout=30, message="the joiner's repair")
    # SIGKILL: the others go on without it, their inner loops never pause, and its helpers die with it
    tree = descendants(joiner.pid)
    assert tree, "the island's DHT, averagers and p2pd should be running"
    killed_at = time.time()
    joiner.signal(signal.SIGKILL)

    def rounds_without_it():
        after = [e for p in _paths(swarm).values() for e in events_of(p, "round")
                 if e["t_start"] > killed_at + 1 and e["outcome"] == "ok"]
        return after if len([e for e in after if e["members"] == ISLANDS]) >= 2 else None

    after = wait_for(rounds_without_it, timeout=60, message="rounds of the three others")
    assert all("late" not in e["members"] for e in after)
    for name, events in _paths(swarm).items():
        steps = events_of(events, "step")
        median = statistics.median(s["dt"] for s in steps)
        gap = max_step_gap(steps, killed_at - 2, time.time())
        print(f"{name}: median step {median:.3f} s, largest gap around the kill {gap:.3f} s")
        assert gap < max(2.0, 4 * median), f"{name}'s inner loop stalled for {gap:.2f} s"
    wait_for(lambda: not any(pid_alive(pid) for pid in tree), timeout=15, message="the joiner's helpers to exit")

    def dropped():  # its record expires (--progress-ttl); the others stay
        names = {i["island"] for i in status_json(swarm.initial_peers, swarm.run_id)["islands"]}
        return names if "late" not in names else None

    assert set(ISLANDS) <= wait_for(dropped, timeout=40, message="the joiner to expire from status")
    assert_clean_error(other(), 4, "fingerprint")
    assert all(island.alive() for name, island in swarm.islands.items() if name in ISLANDS)
    assert all("other" not in e.get("members", []) for path in _paths(swarm).values() for e in events_of(path, "round"))
