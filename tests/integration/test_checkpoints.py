"""Checkpoints in real runs: an island resumes where it stopped, and a whole swarm stopped and
restarted loses no completed outer round."""

from __future__ import annotations

import pytest

from p2p_diloco.island.checkpoint import list_checkpoints, load_checkpoint
from p2p_diloco.lab.localswarm import LocalSwarm
from tests.integration.helpers import FAST, events_of, wait_for

pytestmark = pytest.mark.integration


def test_a_whole_swarm_restarts_from_its_checkpoints_without_losing_a_round(tmp_path):
    names = ["c0", "c1"]

    def flags(name, index):
        return [*FAST, "--data-shard-index", str(index), "--checkpoint-dir", str(tmp_path / name),
                "--checkpoint-every", "5"]

    first = LocalSwarm(tmp_path / "first", run_id="ckpt")
    try:
        first.start_bootstrap()
        for index, name in enumerate(names):
            first.start_island(name, *flags(name, index))
        wait_for(lambda: all(len([e for e in events_of(first.events_path(n), "round") if e["outcome"] == "ok"]) >= 2
                             for n in names), timeout=150, message="rounds before the stop")
        wait_for(lambda: all(events_of(first.events_path(n), "checkpoint") for n in names), timeout=30,
                 message="periodic checkpoints")
    finally:
        first.close()
    saved = {}
    for name in names:
        summary = first.summary(name)
        assert summary["checkpoint"] and summary["stop_reason"] == "signal"
        newest = load_checkpoint(list_checkpoints(tmp_path / name)[0])
        # the checkpoint written at exit holds the last completed round of every fragment
        assert [f.version for f in newest.fragments] == summary["fragment_versions"]
        saved[name] = (summary["fragment_versions"], summary["inner_steps"])

    second = LocalSwarm(tmp_path / "second", run_id="ckpt")
    try:
        second.start_bootstrap()
        for index, name in enumerate(names):
            # 30 more inner steps than it saved (max-steps counts every step of the island)
            second.start_island(name, *flags(name, index), "--max-steps", str(saved[name][1] + 30))
        assert second.wait_islands(150) == {name: 0 for name in names}
    finally:
        second.close()
    for name in names:
        resume = events_of(second.events_path(name), "resume")
        assert resume and resume[0]["versions"] == saved[name][0] and resume[0]["inner_step"] == saved[name][1]
        rounds = [e for e in events_of(second.events_path(name), "round") if e["outcome"] == "ok"]
        assert rounds, "the restarted islands average again"
        first_round = rounds[0]
        assert first_round["base_version"] == saved[name][0][first_round["fragment"]]  # no round lost
        summary = second.summary(name)
        assert summary["resumed_from"] and summary["inner_steps"] > saved[name][1]
