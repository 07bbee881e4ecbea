"""Sixteen lightweight islands on 127.0.0.1 (issue 18; docs/SCALE.md, "Many islands on one machine"):
the product's islands with the lab's synthetic learner, so that 16 of them fit 2 cores, 12 of them as
client-mode members (as islands behind NAT are: their DHT nodes store and serve nothing)."""

from __future__ import annotations

import pytest

from p2p_diloco.lab.scale import measure, parse_args
from p2p_diloco.procs import StopSignal
from tests.integration.helpers import rounds_by_slot

pytestmark = pytest.mark.integration


def test_sixteen_islands_complete_rounds_in_one_group_and_agree_on_every_fragment_version(tmp_path):
    # a round every 8 s (one fragment), 2 of them measured once all 16 train (about 40 s of start-up here)
    args = parse_args(["--islands", "16", "--client-islands", "12", "--rounds", "2", "--period", "8",
                       "--step-s", "0.5", "--matchmaking-time", "2", "--progress-period", "4", "--start-timeout", "300"])
    row = measure(16, args, tmp_path, StopSignal())
    assert not row["leftover_processes"], "processes had to be force-killed"
    assert row["records_seen"]["max"] == 16  # an observer sees every island's progress record
    outcomes = row["outcomes"]
    assert outcomes.get("ok", 0) >= 0.75 * sum(outcomes.values()), outcomes
    assert row["group_size"]["median"] >= 12, row["group_size"]
    assert row["states_per_slot"]["max"] == 1, row["states_per_slot"]  # each slot ends in one state
    # every ok round of a slot ends at one fragment version, the next after the group's newest base (a
    # member that missed an earlier round joins from its older base and takes the round's result:
    # docs/DESIGN.md, "Joining, lagging and forks"). Their states may differ in slots outside the
    # measured ones: members that lost different reducers mid-round keep their own values there
    by_slot = rounds_by_slot({path.name: path for path in (tmp_path / "n16").glob("*.events.jsonl")})
    slots = {slot: [e for e in rounds.values() if e["outcome"] == "ok"] for slot, rounds in by_slot.items()}
    slots = {slot: ok for slot, ok in slots.items() if ok}
    assert len(slots) >= 2
    for slot, ok in slots.items():
        newest = max(e["base_version"] for e in ok)
        assert {e["new_version"] for e in ok} == {newest + 1}, (slot, ok)
