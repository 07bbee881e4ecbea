"""The volunteer swarm simulator (p2p_diloco/lab/volunteers.py) on cases with closed-form answers."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from pydantic import ValidationError

from p2p_diloco.lab.volunteers import VolunteerConfig, simulate_volunteers

FOREVER = dict(stay_mean_s=1e12, stay_shape=1.0)  # nobody leaves within the window
INSTANT = dict(startup_s=0.0, state_bytes=0.0)  # newcomers train at once


def _shares(result) -> float:
    return result.goodput + result.startup + result.departure + result.alone


def test_islands_that_never_leave_contribute_all_their_work():
    result = simulate_volunteers(VolunteerConfig(islands=20, hours=6.0, speed_sd=0.8, **FOREVER, **INSTANT))
    assert result.goodput == pytest.approx(1.0) and result.startup == result.departure == result.alone == 0.0
    assert result.present == pytest.approx(20.0) and result.rounds_ok == 36 and result.rounds_fallback == 0
    assert result.joins == 0


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_departure_loses_the_work_since_its_islands_last_round(fragments):
    """Exponential stays of mean S, rounds every T: an island that leaves loses min(its stay, the
    time since the slot before), the slot's phase uniform in T, so the contributed share is
    (S / T) (1 - exp(-T / S)), whatever the fragments (each holds 1/P of the work, its phase uniform)."""
    stay, period = 2 * 3600.0, 600.0
    result = simulate_volunteers(VolunteerConfig(islands=200, stay_mean_s=stay, stay_shape=1.0, speed_sd=0.0,
                                                 outer_period_s=period, fragments=fragments, hours=48.0, **INSTANT))
    assert result.goodput == pytest.approx(stay / period * (1 - math.exp(-period / stay)), abs=0.002)
    assert result.startup == 0.0 and result.alone == 0.0 and _shares(result) == pytest.approx(1.0)
    assert result.present == pytest.approx(200, rel=0.05) and result.joins == pytest.approx(200 * 24, rel=0.05)


def test_newcomers_lose_their_start_up_and_download():
    """Exponential stays of mean S: a newcomer that trains c seconds after it arrives loses
    E[min(stay, c)] = S (1 - exp(-c / S)) of its S seconds."""
    stay, startup, state, rate = 3600.0, 200.0, 1e9, 10e6  # 200 s + 100 s of download
    config = VolunteerConfig(islands=200, stay_mean_s=stay, stay_shape=1.0, speed_sd=0.0, startup_s=startup,
                             state_bytes=state, bandwidth_Bps=rate, outer_period_s=60.0, hours=24.0)
    result = simulate_volunteers(config)
    assert config.download_s == pytest.approx(100.0)
    assert result.startup == pytest.approx(1 - math.exp(-300.0 / stay), abs=0.003)
    assert _shares(result) == pytest.approx(1.0)


def test_below_the_quorum_work_is_carried_over_then_one_fork_is_kept():
    # two islands and a quorum of 3: every round falls back; each carries its work over twice, then
    # both step alone at the same slot and the swarm keeps one of the two forks
    two = simulate_volunteers(VolunteerConfig(islands=2, quorum=3, speed_sd=0.0, hours=10.0, **FOREVER, **INSTANT))
    assert two.rounds_ok == 0 and two.rounds_fallback == 60
    assert two.alone == pytest.approx(0.5, abs=0.03) and _shares(two) == pytest.approx(1.0)
    # alone, its own steps are the swarm's
    one = simulate_volunteers(VolunteerConfig(islands=1, speed_sd=0.0, hours=10.0, **FOREVER, **INSTANT))
    assert one.goodput == pytest.approx(1.0) and one.rounds_fallback == 60


def test_shares_add_up_and_a_seed_decides_the_run():
    config = VolunteerConfig(islands=30, stay_mean_s=1800.0, hours=12.0, quorum=4, grace_s=30.0)
    first, again = simulate_volunteers(config), simulate_volunteers(config)
    assert first == again and _shares(first) == pytest.approx(1.0)
    assert simulate_volunteers(config.model_copy(update={"seed": 1})) != first


def test_bad_settings_are_refused():
    with pytest.raises(ValidationError):
        VolunteerConfig(islands=0)
    with pytest.raises(ValidationError):
        VolunteerConfig(islands=10, stay_mean_s=math.inf)
    with pytest.raises(ValidationError):
        VolunteerConfig(islands=10, bandwidth_Bps=0)


def test_the_command_prints_one_row_per_size_and_refuses_mixed_simulations(tmp_path):
    import argparse
    import threading
    from types import SimpleNamespace

    from p2p_diloco.errors import ConfigError
    from p2p_diloco.lab.commands import SIMULATE

    done = subprocess.run([sys.executable, "-m", "p2p_diloco", "simulate", "--volunteers", "5", "50", "--hours", "2",
                           "--stay-h", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| 5 (", "| 50 ("))]
    assert len(rows) == 2 and all("%" in row for row in rows)
    assert (tmp_path / "goodput.png").read_bytes().startswith(b"\x89PNG") and (tmp_path / "results.json").exists()
    parser = argparse.ArgumentParser()
    SIMULATE.add_arguments(parser)
    stop = SimpleNamespace(event=threading.Event())
    for flags, message in ((["--volunteers", "5", "--paper"], "different simulations"),
                           (["--volunteers", "5", "--chips", "8"], "drop --chips"),
                           (["--volunteers", "0"], "above 0"), (["--volunteers", "5", "--stay-h", "0"], "stay")):
        with pytest.raises(ConfigError, match=message):  # (the CLI prints it as one line, exit code 2)
            SIMULATE.run(parser.parse_args(flags), stop)
