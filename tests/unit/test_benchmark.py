"""Benchmark figures (p2p_diloco/benchmark.py) from hand-made event logs: pure logic, no processes."""

from __future__ import annotations

import pytest

from p2p_diloco.lab.baselines import Meter, ring_bytes
from p2p_diloco.lab.benchmark import (COLUMNS, arm_figures, combine, compute_intervals, learner_utilization, lost_after,
                                  stall_per_failure)
from p2p_diloco.lab.experiment import table


def _steps(start, count, dt=1.0, gap=0.1, comm=0.0, stalls=None):
    """Step events every dt + gap seconds; ``stalls`` maps a step index to extra seconds before it."""
    events, t = [], start
    for i in range(count):
        t += (stalls or {}).get(i, 0.0)
        t += dt
        events.append({"event": "step", "t": t, "dt": dt, "comm": comm, "step": i + 1, "tokens": 2048 * (i + 1)})
        t += gap
    return events


def test_compute_intervals_leave_blocked_time_out():
    (start, end), = compute_intervals([{"event": "step", "t": 10.0, "dt": 1.0, "comm": 0.25}])
    assert (start, end) == (9.25, 10.0)
    assert compute_intervals([{"event": "step", "t": 10.0, "dt": 1.0}]) == [(9.0, 10.0)]  # ours: no comm field


def test_utilization_counts_blocked_time_and_gaps_but_not_evaluations():
    events = _steps(0.0, 10, dt=1.0, gap=0.0, comm=0.1)
    assert learner_utilization(events) == pytest.approx(0.9)
    # an evaluation between two steps is not lost compute
    events = _steps(0.0, 5, gap=0.0) + [{"event": "eval", "t": 7.0, "dt": 2.0}] + _steps(7.0, 5, gap=0.0)
    assert learner_utilization(events) == pytest.approx(1.0)


def test_lost_after_counts_only_gaps_beyond_the_usual_one():
    steady = _steps(0.0, 40)
    assert lost_after(steady, 20.0) == pytest.approx(0.0, abs=1e-9)
    stalled = _steps(0.0, 40, stalls={25: 3.0})
    assert lost_after(stalled, 20.0) == pytest.approx(3.0)
    assert lost_after(stalled, 33.0) == pytest.approx(0.0, abs=1e-9)  # the stall was before
    assert lost_after(_steps(0.0, 2), 1.0) is None  # too few steps to know the usual gap


def test_lost_after_a_late_start_or_an_early_finish():
    # a learner that started after the kill: its usual gap comes from its whole run
    late = _steps(30.0, 20, stalls={10: 2.0})
    assert lost_after(late, 20.0) == pytest.approx(2.0)
    # one that started just before: 3 steps before the kill are too few, the whole run decides
    assert lost_after(_steps(17.0, 20, stalls={10: 2.0}), 20.0) == pytest.approx(2.0)
    # one that had already finished lost nothing after the kill
    assert lost_after(_steps(0.0, 10), 50.0) == 0.0


def test_lost_after_counts_replayed_steps():
    # steps 1..30, then a restart from a checkpoint at step 25: steps 26..30 are done again
    events = _steps(0.0, 30)
    replay = _steps(events[-1]["t"] + 0.1, 5)
    for i, event in enumerate(replay):
        event["step"] = 26 + i
    assert lost_after(events + replay, 20.0) == pytest.approx(5.0)  # 5 replayed steps of 1 s


def test_stall_per_failure_compares_the_survivors_means_between_passes():
    clean = {"lost_after_mid": {"island-0": 1.0, "island-2": 0.5, "island-3": 0.0}}
    failed = {"lost_after_mid": {"island-0": 4.0, "island-2": 0.5, "island-3": 2.0}}
    assert stall_per_failure(clean, failed) == 1.667  # (6.5 - 1.5) / 3, rounded to ms
    # which survivor waits changes between runs: only the means are compared, noise may go below 0
    assert stall_per_failure(clean, {"lost_after_mid": {"island-0": 0.2, "island-2": None}}) == -0.8
    assert stall_per_failure(clean, {"lost_after_mid": {}}) is None


def test_arm_figures_and_table_against_ddp():
    def learner(name, loss, comm, sent):
        events = _steps(0.0, 10, comm=comm) + [{"event": "eval", "t": 12.0, "dt": 0.5, "tokens": 20480,
                                                 "eval_loss": loss}]
        return events, {"tokens": 20480, "bytes_sent": sent}

    def arm(name, loss, comm, sent):
        built = {f"island-{r}": learner(f"island-{r}", loss, comm, sent) for r in range(2)}
        return arm_figures(name, {n: e for n, (e, _) in built.items()}, {n: s for n, (_, s) in built.items()},
                           mid=6.0)

    ddp, ours = arm("ddp", 5.0, 0.5, 20480 * 3000), arm("ours", 5.1, 0.0, 20480 * 10)
    assert ddp["tokens"] == 2 * 10 * 2048 and ddp["bytes_per_token"] == 3000.0
    assert ddp["utilization"] == pytest.approx(5 / 10.9, abs=1e-4)
    assert ours["utilization"] == pytest.approx(10 / 10.9, abs=1e-4)
    rows = combine([ddp, ours], [ddp, ours])
    assert rows[1]["eval_vs_ddp"] == "+2.0%" and rows[1]["fewer_bytes_than_ddp"] == 300.0
    assert rows[1]["stall_per_failure"] == 0.0
    text = table(rows, COLUMNS)
    assert text.count("\n") == 3 and "| ours | 5.1 | +2.0% |" in text


def test_ring_bytes_and_meter():
    assert ring_bytes(4000, 4) == 6000 and ring_bytes(4000, 2) == 4000 and ring_bytes(4000, 1) == 0
    meter = Meter()
    meter.add(seconds=0.3, sent=100)
    meter.add(seconds=0.2)
    event = meter.annotate({"event": "step", "dt": 1.0})
    assert event["comm"] == pytest.approx(0.5) and event["bytes_sent"] == 100
    assert meter.annotate({"event": "step", "dt": 1.0})["comm"] == 0.0  # reset after each step
    assert meter.annotate({"event": "eval"}) == {"event": "eval"}
