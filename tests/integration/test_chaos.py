"""A reduced chaos schedule on the tiny preset: a faulty island, bootstrap death, a freeze, and a
kill and restart whose donor is killed while the restarted island downloads the global state from it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from p2p_diloco.island.checkpoint import list_checkpoints, load_checkpoint
from p2p_diloco.algo.outer import all_finite
from tests.integration.helpers import cli, events_of

pytestmark = pytest.mark.integration

# the documented reduced schedule (docs/CHAOS.md)
SCHEDULE = (Path(__file__).resolve().parents[2] / "docs" / "chaos" / "reduced.toml").read_text()


def test_reduced_chaos_schedule_keeps_training_and_heals(tmp_path):
    schedule = tmp_path / "schedule.toml"
    schedule.write_text(SCHEDULE)  # islands checkpoint into their own folders at exit: Theta can be inspected
    done = cli("chaos", "--schedule", str(schedule), "--out", str(tmp_path / "run"), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    figures = report["figures"]
    assert figures["global_downtime_seconds"] == 0
    assert figures["stall_per_failure"] and figures["stall_seconds_max"] < 1.0
    first = figures["rejoin"][0]
    assert first["island"] == "island-1" and first["seconds"] is not None  # it contributes again
    # island-1 restarts again; whoever serves its download is killed mid-download and the joiner fails over
    (donor_kill,) = report["donor_kills"]
    assert donor_kill["joiner"] == "island-1" and donor_kill["donor"] in ("island-0", "island-2")
    assert donor_kill["joiner_joined"] and donor_kill["failover_donors"]
    # frozen after the bootstrap died, island-2 finds the others again and averages with them
    thaw = max(f["t"] for f in report["faults"] if f["kind"] == "thaw")
    rounds = events_of(tmp_path / "run" / "island-2.events.jsonl", "round")
    assert any(e["outcome"] == "ok" and e["contributed"] and e["t_start"] > thaw for e in rounds)
    for name, losses in report["eval_loss"].items():
        assert losses["last"] < losses["first"] - 1.0, name
    # the faulty island is caught by the others and kept out of their rounds from then on
    assert report["flagged"]["island-1"] == report["flagged"]["island-2"] == ["island-0"]
    assert report["flagged"]["island-0"] == []
    for name in ("island-1", "island-2"):  # (caught in a rejected round, or adopted from the others' records)
        rounds = [e for e in events_of(tmp_path / "run" / f"{name}.events.jsonl", "round")]
        flags = events_of(tmp_path / "run" / f"{name}.events.jsonl", "flag")
        # every life of the island flags it again (a restarted one adopts the others' flags)
        lives = [e["t"] for e in events_of(tmp_path / "run" / f"{name}.events.jsonl", "start")]
        for start, end in zip(lives, lives[1:] + [float("inf")]):
            flagged_at = min((f["t"] for f in flags if start <= f["t"] < end), default=end)
            assert all("island-0" not in e["members"] for e in rounds
                       if e["outcome"] == "ok" and flagged_at < e["t_start"] < end)
    assert any(f["how"] == "caught" for name in ("island-1", "island-2")
               for f in events_of(tmp_path / "run" / f"{name}.events.jsonl", "flag"))
    assert (tmp_path / "run" / "timeline.png").read_bytes().startswith(b"\x89PNG")
    # no checkpoint lost: every file reads back and verifies, and no restart skipped its newest one
    assert report["checkpoints"]["files"] >= 2 and report["checkpoints"]["unreadable"] == []
    assert report["checkpoints"]["resumed_older"] == report["checkpoints"]["not_resumed"] == 0
    saved_dirs = [d for d in (tmp_path / "run" / "checkpoints").iterdir() if list_checkpoints(d)]
    assert len(saved_dirs) >= 2  # islands that were running at the end checkpointed at exit
    for checkpoint_dir in saved_dirs:  # their final global parameters are finite
        saved = load_checkpoint(list_checkpoints(checkpoint_dir)[0])
        assert all(all_finite(f.theta) and all_finite(f.momentum) for f in saved.fragments)
        assert all(math.isfinite(v) for v in saved.params["model.norm.weight"].flatten().tolist())
