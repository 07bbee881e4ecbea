"""The failure simulator (p2p_diloco/lab/simulate.py) on cases with closed-form answers."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from pydantic import ValidationError

from p2p_diloco.lab.simulate import (PAPER_CHIPS, SimConfig, paper_cells, paper_table, simulate,
                                     straggler_efficiency, young_interval)

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


def test_checkpoints_cost_their_saves_and_a_failure_loses_the_training_since_the_last_completed_one():
    config = SimConfig(arm="dp", checkpoint_s=1000.0, checkpoint_save_s=10.0, **BASE)
    # 10 h = 35 cycles of 1000 s training + 10 s saving, then 650 s of training
    assert simulate(config, failures=[]).goodput == pytest.approx(35650 / 36000)
    # a failure at 7200 s (7 cycles and 130 s): 7000 s kept; back at 9600 s, then 26 cycles and 140 s
    down = BASE["repair_s"] + BASE["restart_s"]
    assert simulate(config, failures=[(2 * HOUR, 1)]).goodput == pytest.approx((7000 + 26140) / 36000)
    # a failure while the 8th checkpoint is saved (7075 s) loses its 1000 s of training
    saving = simulate(config, failures=[(7075.0, 1)])
    assert 36000 - 7075 - down == 26 * 1010 + 265
    assert saving.goodput == pytest.approx((7000 + 26 * 1000 + 265) / 36000)
    # Young's interval: sqrt(2 x 2 s x 100 s between failures)
    assert young_interval(2.0, 0.01) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="must be positive"):
        young_interval(0.0, 0.01)


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


def test_in_time_steps_a_failure_acts_at_its_steps_end_and_one_in_a_restarts_last_step_is_taken_in():
    config = dict(chips=1024, slice_chips=256, hours=1.0, repair_s=0.0, restart_s=55.0)
    failures = [(12.0, 1), (75.0, 2)]
    continuous = simulate(SimConfig(arm="dp", **config), failures=failures)
    assert continuous.downtime_s == pytest.approx(2 * 55.0)  # the second comes after the first restart
    stepped = simulate(SimConfig(arm="dp", tick_s=10.0, **config), failures=failures)
    # the first acts at 20 s (the 8 s from 12 to 20 s still train); the restart, 55 s in whole steps, ends at 80 s;
    # the second failure, in the restart's last step, acts at 80 s before the restart ends: taken in
    assert stepped.failures == 2
    assert stepped.downtime_s == pytest.approx(60.0)
    assert stepped.goodput == pytest.approx(1 - 60.0 / 3600)


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


def test_a_repaired_slice_waits_for_the_next_pause_at_most_the_rejoin_wait():
    c, r, w, slices, t = BASE["resize_s"], BASE["repair_s"], 300.0, 4, 2 * HOUR
    config = SimConfig(arm="elastic", rejoin_wait_s=w, **BASE)

    def lost(result):  # slice-seconds
        return (1 - result.goodput) * slices * 10 * HOUR

    # no other pause comes: the slice idles w more, then pauses the job for itself
    alone = simulate(config, failures=[(t, 3)])
    assert lost(alone) == pytest.approx(slices * c + (r - c) + w + slices * c)
    assert alone.downtime_s == pytest.approx(2 * c)
    # slice 2 fails 100 s after slice 3 is back: that pause takes slice 3 back too
    t2 = t + r + 100
    shared = simulate(config, failures=[(t, 3), (t2, 2)])
    assert lost(shared) == pytest.approx(slices * c + (t2 - t - c) + slices * c + (r - c) + w + slices * c)
    assert shared.downtime_s == pytest.approx(3 * c)
    # slice 3 fails again while it waits: the job never had it back; it rejoins after its second repair
    again = simulate(config, failures=[(t, 3), (t2, 3)])
    assert again.failures == 2
    assert lost(again) == pytest.approx(slices * c + (t2 + r + w - t - c) + slices * c)
    # a learner with no slice up takes its slice back at once (rejoin_wait_s changes nothing)
    learner = SimConfig(arm="learners", learners=4, rejoin_wait_s=w, **BASE)
    assert simulate(learner, failures=[(t, 1)]).goodput == pytest.approx(1 - (r + c) / (4 * 10 * HOUR))


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


def test_a_chaos_schedule_is_predicted_from_its_outages():
    from p2p_diloco.lab.chaos import ChaosConfig, Fault
    from p2p_diloco.lab.simulate import chaos_failures, predict_chaos

    schedule = ChaosConfig(islands=4, minutes=1.0, period=10.0, fragments=1, faults=[
        Fault(at=5, kind="kill", island="island-1", restart_after=10),  # down 10 s + 5 s start-up
        Fault(at=20, kind="freeze", island="island-2", duration=8),  # down 8 s
        Fault(at=25, kind="cut", island="island-3", duration=10),  # trains on: no outage
        Fault(at=30, kind="kill_donor", island="island-0", restart_after=4)])  # 5 s; its donor island-1 4 + 5 s
    assert chaos_failures(schedule, startup_s=5.0) == [(5, 1, 15.0), (20, 2, 8.0), (30, 0, 5.0), (32.5, 1, 9.0)]
    config, result = predict_chaos(schedule, startup_s=5.0, utilization=0.5)
    assert (config.learners, config.chips, config.outer_period_s) == (4, 4, 10.0)
    assert result.goodput == pytest.approx(0.5 * (1 - (15 + 8 + 5 + 9) / (4 * 60)))
    assert result.downtime_s == pytest.approx(0.0) and result.rounds_fallback == 0  # 3 of 4 always train


def test_the_help_gives_the_paper_fits_values():
    import argparse

    from p2p_diloco.lab.commands import _simulate_arguments
    from p2p_diloco.lab.simulate import PAPER_ASSUMPTIONS

    parser = argparse.ArgumentParser()
    _simulate_arguments(parser)
    text = " ".join(parser.format_help().split())
    dp, elastic = PAPER_ASSUMPTIONS["dp"], PAPER_ASSUMPTIONS["elastic"]
    for value in (dp["slice_chips"], dp["tick_s"], dp["restart_s"], elastic["resize_s"], elastic["rejoin_wait_s"]):
        assert f"the paper fit's, {value:g})" in text, value
    assert f"the paper fit's, {dp['repair_s']:g} for data-parallel" in text and f"{elastic['repair_s']:g} otherwise" in text
    assert dp["tick_s"] == elastic["tick_s"] and dp["slice_chips"] == elastic["slice_chips"]
