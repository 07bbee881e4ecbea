"""Checkpoints in real runs: a whole swarm stopped and restarted loses no completed outer round, and
each island resumes where it stopped, at the same data position. The islands train the user's own
model (a GPT-2 folder saved by the test, from its config) on a token folder of `prepare-data`."""

from __future__ import annotations

import pytest

from p2p_diloco.island.checkpoint import list_checkpoints, load_checkpoint
from p2p_diloco.lab.localswarm import LocalSwarm
from tests.integration.helpers import FAST, cli, events_of, wait_for

pytestmark = pytest.mark.integration


def test_a_whole_swarm_restarts_from_its_checkpoints_without_losing_a_round(tmp_path):
    names = ["c0", "c1"]
    from transformers import GPT2Config

    GPT2Config(n_embd=128, n_layer=4, n_head=4, vocab_size=2048, n_positions=128, bos_token_id=0,
               eos_token_id=0).save_pretrained(tmp_path / "gpt2")
    prepared = cli("prepare-data", "--out", str(tmp_path / "tokens"), "--vocab-size", "2048")
    assert prepared.returncode == 0 and "training and" in prepared.stdout, prepared.stderr[-2000:]
    own = ["--model", str(tmp_path / "gpt2"), "--data", str(tmp_path / "tokens")]

    def flags(name, index):
        return [*FAST, *own, "--data-shard-index", str(index), "--checkpoint-dir", str(tmp_path / name),
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
        saved[name] = (summary["fragment_versions"], summary["inner_steps"], newest.meta["sampler"]["batches_drawn"])
        assert saved[name][2] == newest.meta["inner_step"] > 0  # one batch per inner step

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
        assert resume[0]["batches_drawn"] == saved[name][2]  # the same data position
        rounds = [e for e in events_of(second.events_path(name), "round") if e["outcome"] == "ok"]
        assert rounds, "the restarted islands average again"
        first_round = rounds[0]
        assert first_round["base_version"] == saved[name][0][first_round["fragment"]]  # no round lost
        summary = second.summary(name)
        assert summary["resumed_from"] and summary["inner_steps"] > saved[name][1]
