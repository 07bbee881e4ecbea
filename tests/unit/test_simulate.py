"""The failure simulator (p2p_diloco/lab/simulate.py) on cases with closed-form answers."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from pydantic import ValidationError

from p2p_diloco.lab.simulate import PAPER_CHIPS, SimConfig, paper_cells, paper_table, simulate, straggler_efficiency

HOUR = 3600.0
BASE = dict(chips=1024, slice_chips=256, hours=10.0, repair_s=1800.0, restart_s=600.0, resize_s=60.0)
NEVER = dict(chip_mtbi_s=1e30)  # (no failure within the horizon)


@pytest.mark.parametrize("arm,learners", [("dp", 1), ("elastic", 1), ("learners", 4)])
def test_without_failures_every_arm_has_goodput_and_uptime_1(arm, learners):
    result = simulate(SimConfig(arm=arm, learners=learners, **BASE, **NEVER))
    assert result.goodput == pytest.approx(1.0) and result.uptime == pytest.approx(1.0)
    assert result.failures == 0 and result.downtime_s == pytest.approx(0.0)


def test_one_failure_stops_data_parallel_until_the_slice_is_back_and_the_job_restarted():
    result = simulate(SimConfig(arm="dp", **BASE), failures=[(2 * HOUR, 1)])
    down = BASE["repair_s"] + BASE["restart_s"]
    assert result.failures == 1
    assert result.downtime_s == pytest.approx(down)
    assert result.goodput == pytest.approx(1 - down / (10 * HOUR))
    # a checkpoint every 1000 s: the 7200 s trained before the failure lose the last 200 s
    lost = simulate(SimConfig(arm="dp", checkpoint_s=1000.0, **BASE), failures=[(2 * HOUR, 1)])
    assert lost.goodput == pytest.approx(1 - (down + 200.0) / (10 * HOUR))


def test_a_failure_during_the_restart_starts_it_over_or_is_taken_in_by_it():
    # slice 1 fails at 0.5 h (back at 1 h, restarted at 1 h 10 min); slice 2 fails at 1 h 5 min
    failures = [(0.5 * HOUR, 1), (1.0833 * HOUR, 2)]
    over = simulate(SimConfig(arm="dp", restart_absorbs=False, **BASE), failures=failures)
    back = 1.0833 * HOUR + BASE["repair_s"] + BASE["restart_s"]
    assert over.downtime_s == pytest.approx(back - 0.5 * HOUR)
    # taken in: the restart ends when slice 2 is back (1 h 35 min), not a restart after that
    taken = simulate(SimConfig(arm="dp", **BASE), failures=failures)
    assert taken.downtime_s == pytest.approx(1.0833 * HOUR + BASE["repair_s"] - 0.5 * HOUR)
    # with spares at hand (repair 0), the restart under way simply goes on
    spares = simulate(SimConfig(arm="dp", **{**BASE, "repair_s": 0.0}), failures=[(0.5 * HOUR, 1), (0.5 * HOUR + 300, 2)])
    assert spares.downtime_s == pytest.approx(BASE["restart_s"])


def test_elastic_data_parallel_pauses_for_each_change_and_trains_on_the_slices_up_between():
    c, r, slices = BASE["resize_s"], BASE["repair_s"], 4
    result = simulate(SimConfig(arm="elastic", **BASE), failures=[(2 * HOUR, 3)])
    # paused c, then 3 of 4 slices until the repair, paused c again
    lost = slices * c + (r - c) + slices * c  # in slice-seconds
    assert result.goodput == pytest.approx(1 - lost / (slices * 10 * HOUR))
    assert result.downtime_s == pytest.approx(2 * c)
    # a second failure during the first pause is applied by that pause
    both = simulate(SimConfig(arm="elastic", **BASE), failures=[(2 * HOUR, 3), (2 * HOUR + 10, 2)])
    assert both.downtime_s == pytest.approx(2 * c)  # one pause for both failures, one for both repairs


def test_a_learners_failure_costs_only_its_own_slices():
    # 4 learners of one slice each; learner 1's slice fails: it pauses and trains on nothing until repaired
    config = SimConfig(arm="learners", learners=4, **BASE, outer_period_s=600.0, quorum=3)
    result = simulate(config, failures=[(2 * HOUR, 1)])
    assert result.downtime_s == pytest.approx(0.0) and result.uptime == pytest.approx(1.0)
    assert result.goodput == pytest.approx(1 - (BASE["repair_s"] + BASE["resize_s"]) / (4 * 10 * HOUR))
    assert result.rounds_ok == 59 and result.rounds_fallback == 0  # 3 of 4 still meet at every slot (600 s, ..., 35400 s)
    rigid = simulate(config.model_copy(update={"learner_mode": "rigid"}), failures=[(2 * HOUR, 1)])
    assert rigid.goodput == pytest.approx(1 - (BASE["repair_s"] + BASE["restart_s"]) / (4 * 10 * HOUR))


def test_rounds_below_the_quorum_fall_back_unless_learners_return_within_the_grace_window():
    # learner 0 of 2 is down from 1 h to 1 h 30 min + 60 s; quorum 2: the slots in between fall back
    config = SimConfig(arm="learners", learners=2, chips=512, slice_chips=256, hours=2.0, repair_s=1800.0,
                       resize_s=60.0, outer_period_s=600.0, quorum=2)
    result = simulate(config, failures=[(HOUR + 1.0, 0)])
    assert (result.rounds_ok, result.rounds_fallback) == (8, 3)  # of slots 600 s, ..., 6600 s: 4200, 4800, 5400 fall back
    # the slot at 5400 s: learner 0 is back at 5461 s, within a 120 s grace window
    graced = simulate(config.model_copy(update={"grace_s": 120.0}), failures=[(HOUR + 1.0, 0)])
    assert (graced.rounds_ok, graced.rounds_fallback) == (9, 2)


def test_random_failures_are_deterministic_under_a_seed_and_match_the_renewal_formula():
    config = SimConfig(arm="dp", chips=4096, slice_chips=256, chip_mtbi_s=4096 * HOUR, repair_s=0.0,
                       restart_s=360.0, hours=2000.0, seed=7)
    first, again = simulate(config), simulate(config)
    assert first == again
    assert simulate(config.model_copy(update={"seed": 8})) != first
    # one failure an hour on average (each counts: spares at hand, repair 0), each 0.1 h down (a failure
    # during a restart is taken in by it): uptime 1 / (1 + 0.1) (renewal-reward), within the spread of
    # ~2000 failures
    assert first.failures == pytest.approx(2000, rel=0.1)
    assert first.goodput == pytest.approx(1 / 1.1, abs=0.01)


def test_stragglers_slow_a_job_by_its_expected_slowest_slice():
    assert straggler_efficiency(1, 1.0, 0.1) == 1.0 and straggler_efficiency(64, 1.0, 0.0) == 1.0
    # the expected maximum of 2 standard normals is 1/sqrt(pi) = 0.564 (Blom: 0.589)
    assert straggler_efficiency(2, 1.0, 0.1) == pytest.approx(1 / (1 + 0.1 / math.sqrt(math.pi)), rel=0.005)
    assert straggler_efficiency(1024, 1.0, 0.1) < straggler_efficiency(64, 1.0, 0.1)


def test_configurations_that_do_not_split_are_refused():
    with pytest.raises(ValidationError, match="multiple of slice_chips"):
        SimConfig(arm="dp", chips=1000, slice_chips=256)
    with pytest.raises(ValidationError, match="split evenly into 3 learners"):
        SimConfig(arm="learners", learners=3, chips=1024, slice_chips=256)


def test_the_papers_table_is_simulated_cell_by_cell_and_keeps_its_order():
    rows = paper_table(paper_cells(hours=24.0))
    assert len(rows) == 30 and {row["label"] for row in rows} == {"data-parallel", "elastic data-parallel", "M = 2",
                                                                   "M = 4", "M = 8", "M = 16"}
    ours = {(row["label"], row["chips"]): row["ours"] for row in rows}
    labels = ["data-parallel", "elastic data-parallel", "M = 2", "M = 4", "M = 8", "M = 16"]
    for label in labels:  # more chips, more failures: less goodput
        row = [ours[label, chips] for chips in PAPER_CHIPS]
        assert row == sorted(row, reverse=True), (label, row)
    for chips in PAPER_CHIPS:  # more learners of fewer chips each: more goodput
        column = [ours[label, chips] for label in labels]
        assert column == sorted(column), (chips, column)


def test_the_command_prints_a_run_and_refuses_bad_values(tmp_path):
    def simulate_command(*flags):
        return subprocess.run([sys.executable, "-m", "p2p_diloco", "simulate", *flags], capture_output=True, text=True,
                              timeout=120)

    done = simulate_command("--arm", "learners", "--learners", "4", "--chips", "1000", "--hours", "24", "--quorum", "3",
                            "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "M = 4, 1,000 chips: goodput" in done.stdout and "ok /" in done.stdout
    assert (tmp_path / "goodput.png").read_bytes().startswith(b"\x89PNG") and (tmp_path / "results.json").exists()
    refused = simulate_command("--arm", "learners", "--learners", "3", "--chips", "1000")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith("error: ") and "do not split evenly into 3 learners" in refused.stderr
