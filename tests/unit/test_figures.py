"""Run figures from event logs, on hand-made timelines."""

import pytest

from p2p_diloco.lab import figures


def _steps(start, end, dt=0.5, gap=0.0):
    events, t = [], start
    while t + dt <= end + 1e-9:
        t += dt
        events.append({"event": "step", "t": t, "dt": dt})
        t += gap
    return events


def test_interval_algebra():
    assert figures.merge([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert figures.length([(0, 1), (0.5, 2), (5, 6)]) == 3
    assert figures.subtract([(0, 10)], [(2, 3), (8, 12)]) == [(0, 2), (3, 8)]
    assert figures.clip([(0, 5), (8, 9)], 4, 8.5) == [(4, 5), (8, 8.5)]


def test_a_fault_free_run_has_full_goodput_and_no_downtime():
    events = {"a": _steps(0, 100), "b": _steps(0, 100)}
    alive = {"a": [(0, 100)], "b": [(0, 100)]}
    result = figures.run_figures(events, start=0, end=100, alive=alive, frozen={})
    assert result.goodput == pytest.approx(1.0) and result.alive_utilization == pytest.approx(1.0)
    assert result.global_downtime == 0


def test_a_killed_island_costs_goodput_not_alive_utilization():
    events = {"a": _steps(0, 100), "b": _steps(0, 40) + _steps(60, 100)}  # b down from 40 to 60
    alive = {"a": [(0, 100)], "b": [(0, 40), (60, 100)]}
    faults = [{"t": 40, "kind": "kill", "island": "b"}, {"t": 60, "kind": "restart", "island": "b"}]
    events["b"].append({"event": "round", "outcome": "ok", "contributed": True, "t_end": 72.5})
    result = figures.run_figures(events, start=0, end=100, alive=alive, frozen={}, faults=faults)
    assert result.goodput == pytest.approx(0.9)
    assert result.alive_utilization == pytest.approx(1.0)
    assert result.global_downtime == 0  # a kept training
    assert result.stall_per_failure == [{"fault": "kill", "t": 40, "island": "a", "seconds": 0.0}]
    assert result.rejoin_seconds[0]["seconds"] == pytest.approx(12.5)
    # it contributed when the all-reduce ended, before its wait for the result's hash (t_end)
    events["b"][-1] |= {"t_merged": 70.0, "t_end": 76.0}
    result = figures.run_figures(events, start=0, end=100, alive=alive, frozen={}, faults=faults)
    assert result.rejoin_seconds[0]["seconds"] == pytest.approx(10.0)
    # one that turned faulty before it contributed is not timed (its rounds are rejected)
    result = figures.run_figures(events, start=0, end=100, alive=alive, frozen={},
                                 faults=faults + [{"t": 65, "kind": "corrupt", "island": "b"}])
    assert result.rejoin_seconds == [{"island": "b", "restarted": 60, "turned_faulty": 65, "first_round": None,
                                      "seconds": None}]
    # nor is one killed again before it contributed: that life is timed to its kill, the next from its restart
    again = [*faults, {"t": 66, "kind": "kill", "island": "b"}, {"t": 68, "kind": "restart", "island": "b"}]
    result = figures.run_figures(events, start=0, end=100, alive=alive, frozen={}, faults=again)
    assert result.rejoin_seconds == [
        {"island": "b", "restarted": 60, "killed_again": 66, "lived_seconds": 6, "first_round": None, "seconds": None},
        {"island": "b", "restarted": 68, "first_round": 70.0, "seconds": 2.0}]
    # a joiner restarted by a kill_donor fault shows only as its next restart: that ends the timing too
    again = [*faults, {"t": 67, "kind": "restart", "island": "b", "why": "kill_donor"}]
    result = figures.run_figures(events, start=0, end=100, alive=alive, frozen={}, faults=again)
    assert result.rejoin_seconds[0] == {"island": "b", "restarted": 60, "killed_again": 67, "lived_seconds": 7,
                                        "first_round": None, "seconds": None}


def test_a_restart_held_back_by_a_cut_a_freeze_or_a_majoritys_probation_says_so():
    events = {name: _steps(0, 200) for name in ("a", "c", "d")}
    events["b"] = _steps(0, 40) + _steps(60, 200) + [{"event": "round", "outcome": "ok", "contributed": True,
                                                      "t_end": 150.0}]
    alive = {"a": [(0, 200)], "c": [(0, 200)], "d": [(0, 200)], "b": [(0, 40), (60, 200)]}
    faults = [{"t": 40, "kind": "kill", "island": "b"}, {"t": 60, "kind": "restart", "island": "b"}]

    def entry(extra_faults=(), flags=()):
        for name, t, seconds in flags:
            events[name].append({"event": "flag", "t": t, "culprit": "b", "seconds": seconds})
        result = figures.run_figures(events, start=0, end=200, alive=alive, frozen={}, faults=[*faults, *extra_faults])
        for name, _, _ in flags:
            events[name].pop()
        return result.rejoin_seconds[0]

    assert "held_back" not in entry() and entry()["seconds"] == pytest.approx(90.0)
    assert entry([{"t": 70, "kind": "cut", "island": "b"}])["held_back"] == ["cut"]
    assert "held_back" not in entry([{"t": 70, "kind": "cut", "island": "a"}])  # another island's cut
    assert "held_back" not in entry([{"t": 125, "kind": "freeze", "island": "b"}])  # past the first 60 s
    # two of the three others held a flag on it during its first minute: a majority
    assert entry(flags=[("a", 30, 120.0), ("c", 50, 120.0)])["held_back"] == ["probation"]
    assert "held_back" not in entry(flags=[("a", 30, 120.0)])  # one of three
    assert "held_back" not in entry(flags=[("a", 0, 30.0), ("c", 0, 30.0)])  # over before the restart


def test_a_pause_of_every_island_is_global_downtime_and_a_survivor_stall():
    a = _steps(0, 50) + _steps(53, 100)  # a stops for 3 s after b is killed at 50
    events = {"a": a, "b": _steps(0, 50)}
    alive = {"a": [(0, 100)], "b": [(0, 50)]}
    result = figures.run_figures(events, start=0, end=100, alive=alive, frozen={},
                                 faults=[{"t": 50, "kind": "kill", "island": "b"}])
    assert result.global_downtime == pytest.approx(3.0)
    assert result.stall_per_failure[0]["seconds"] == pytest.approx(3.0)


def test_frozen_time_is_not_counted_against_alive_utilization():
    events = {"a": _steps(0, 30) + _steps(40, 100)}
    result = figures.run_figures(events, start=0, end=100, alive={"a": [(0, 100)]}, frozen={"a": [(30, 40)]})
    assert result.alive_utilization == pytest.approx(1.0) and result.goodput == pytest.approx(0.9)
    assert result.global_downtime == pytest.approx(10.0)  # the only island was frozen: nobody trained


def test_an_evaluation_is_not_a_stall():
    a = _steps(0, 50) + _steps(51.5, 100)
    a.append({"event": "eval", "t": 51.5, "dt": 1.5})  # 1.5 s of eval right after the fault
    result = figures.run_figures({"a": a, "b": _steps(0, 50)}, start=0, end=100,
                                 alive={"a": [(0, 100)], "b": [(0, 50)]}, frozen={},
                                 faults=[{"t": 50, "kind": "kill", "island": "b"}])
    assert result.stall_per_failure[0]["seconds"] == 0.0


def test_loading_after_a_restart_counts_against_alive_but_not_ready_utilization():
    events = {"a": _steps(0, 100), "b": _steps(0, 40) + _steps(70, 100)}  # b restarted at 60, trains from 70
    alive = {"a": [(0, 100)], "b": [(0, 40), (60, 100)]}
    result = figures.run_figures(events, start=0, end=100, alive=alive, frozen={})
    assert result.loading_seconds == pytest.approx(10.0)
    assert result.alive_utilization == pytest.approx(170 / 180)
    assert result.ready_utilization == pytest.approx(1.0)
    assert figures.loading_intervals(figures.step_intervals(events["b"]), alive["b"]) == [(0, 0), (60, 70)]


def test_a_step_that_straddles_a_freeze_counts_only_its_running_time():
    events = {"a": _steps(0, 30) + [{"event": "step", "t": 40.5, "dt": 10.5}] + _steps(40.5, 100)}
    result = figures.run_figures(events, start=0, end=100, alive={"a": [(0, 100)]}, frozen={"a": [(30, 40)]})
    assert result.useful_seconds == pytest.approx(90.0)
    assert result.alive_utilization == pytest.approx(1.0)


def test_islands_evaluating_at_once_are_working_but_an_idle_pause_is_downtime():
    # c is frozen from 40 to 60; a and b both evaluate from 45 to 47, then both pause from 52 to 54
    a = _steps(0, 45) + _steps(47, 52) + _steps(54, 100) + [{"event": "eval", "t": 47, "dt": 2.0}]
    b = _steps(0, 45) + _steps(47, 52) + _steps(54, 100) + [{"event": "eval", "t": 47, "dt": 2.0}]
    c = _steps(0, 40) + _steps(60, 100)
    result = figures.run_figures({"a": a, "b": b, "c": c}, start=0, end=100,
                                 alive={n: [(0, 100)] for n in "abc"}, frozen={"c": [(40, 60)]})
    assert result.global_downtime == pytest.approx(2.0)
    assert result.downtime_intervals == [(52, 54)]


def test_a_restart_that_skips_its_newest_checkpoint_has_lost_it():
    disk, fresh = "run/checkpoints/island-0", "run/checkpoints/island-0.3"

    def saved(t, ms):
        return {"event": "checkpoint", "t": t, "path": f"{disk}/ckpt-{ms:013d}-000000010.safetensors"}

    def resume(t, ms, folder=disk):
        return {"event": "resume", "t": t, "path": f"{folder}/ckpt-{ms:013d}-000000010.safetensors"}

    start = [{"event": "start", "t": t} for t in (0, 21, 41, 61, 81, 101, 121)]
    events = {"island-0": sorted(start + [saved(10, 10_000), saved(15, 15_000), resume(22, 15_000), saved(30, 30_000),
                                          resume(42, 15_000), saved(50, 50_000), resume(82, 50_000),
                                          resume(102, 55_000)], key=lambda e: e["t"])}
    faults = [{"t": t, "kind": "kill", "island": "island-0"} for t in (19.5, 39.5, 59.5, 79.5, 99.5)] + [
        {"t": t, "kind": "restart", "island": "island-0", "checkpoint_dir": disk} for t in (20, 40, 60, 80, 100)] + [
        {"t": 120, "kind": "restart", "island": "island-0", "why": "kill_donor", "checkpoint_dir": fresh},
        {"t": 130, "kind": "kill_donor", "island": "island-1"},
        {"t": 5, "kind": "restart", "island": "island-1"}]  # a run without checkpoints: no checkpoint_dir
    events["island-0"] = [e for e in events["island-0"] if e["t"] != 61]  # killed again before it started
    outcomes = [(r["t"], r["outcome"]) for r in figures.checkpoint_resumes(events, faults)]
    assert outcomes == [(20, "resumed_newest"), (40, "resumed_older"), (60, "not_started"),
                        (80, "resumed_newest"), (100, "resumed_newest"), (120, "nothing_to_resume")]
    # at 100 s it resumed a file newer than the newest event: its write finished, the kill cut its event off
    assert figures.checkpoint_resumes(events, faults)[4]["expected"] == "ckpt-0000000050000-000000010.safetensors"
    del events["island-0"][[e.get("event") for e in events["island-0"]].index("resume")]
    assert figures.checkpoint_resumes(events, faults)[0]["outcome"] == "not_resumed"
