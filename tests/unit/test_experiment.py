"""Experiment figures and tables, and the summary's bandwidth figures (pure logic, no swarm)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from p2p_diloco.lab.experiment import Arm, arm_figures, table
from p2p_diloco.island.summary import bandwidth_figures


def _summary(tokens, sent, eval_loss, util=0.99, h=20.0):
    return {"tokens": tokens, "bytes_sent": sent, "eval_loss_last": eval_loss, "wall_seconds": 100.0,
            "compute_utilization": util, "inner_steps_per_outer_period": h, "outer_rounds_ok": 5,
            "outer_rounds_failed": 1, "dp_bytes_per_token": 4000.0, "peak_bytes_per_inner_step": 123}


def test_arm_figures_average_islands_and_compare_bytes_with_data_parallel():
    summaries = [_summary(1000, 10_000, 5.0), _summary(3000, 30_000, 5.2, util=0.97, h=None)]
    events = {"a": [{"event": "eval", "tokens": 0, "eval_loss": 7.0}, {"event": "eval", "tokens": 1000, "eval_loss": 5.0}],
              "b": [{"event": "eval", "tokens": 0, "eval_loss": 7.2}, {"event": "eval", "tokens": 3000, "eval_loss": 5.2},
                    {"event": "step", "tokens": 3000}]}
    figures = arm_figures(Arm("x", 2, 10), summaries, events)
    assert figures["eval_loss"] == pytest.approx(5.1) and figures["eval_loss_spread"] == pytest.approx(0.2)
    assert figures["tokens"] == 4000 and figures["bytes_per_token"] == 10.0
    assert figures["reduction_vs_dp"] == 400.0 and figures["h"] == 20.0  # missing H is left out
    assert figures["utilization"] == pytest.approx(0.98) and figures["rounds_ok"] == 10
    assert figures["curve"] == [(0.0, pytest.approx(7.1)), (4000.0, pytest.approx(5.1))]  # swarm tokens


def test_table_lists_every_arm_with_missing_figures_as_dashes():
    text = table([{"arm": "a", "tokens": 12345, "eval_loss": 5.12345}, {"arm": "b"}],
                 [("arm", "arm"), ("tokens", "tokens"), ("eval_loss", "eval loss")])
    assert text.splitlines() == ["| arm | tokens | eval loss |", "|---|---|---|",
                                 "| a | 12,345 | 5.123 |", "| b | - | - |"]


def test_bandwidth_figures_against_a_known_payload():
    sync = SimpleNamespace(bytes_sent=2_000_000, round_bytes_sent=1_500_000, peak_bytes_per_step=50_000)
    figures = bandwidth_figures(sync, tokens=100_000, parameters=1_000_000, tokens_per_step=2048)
    # data-parallel: 2 x 1e6 parameters x 4 bytes per step of 2048 tokens
    assert figures["dp_bytes_per_token"] == pytest.approx(8e6 / 2048, abs=1e-3)
    assert figures["bytes_per_token"] == 20.0 and figures["round_bytes_per_token"] == 15.0
    assert figures["reduction_vs_dp"] == round(8e6 / 2048 / 20.0, 1)
    assert figures["peak_bytes_per_inner_step"] == 50_000
    nothing = bandwidth_figures(SimpleNamespace(bytes_sent=0, round_bytes_sent=0, peak_bytes_per_step=0), 0, 10, 1)
    assert nothing["bytes_per_token"] is None and nothing["reduction_vs_dp"] is None


def test_run_script_maps_failures_to_exit_codes(capsys):
    from p2p_diloco.lab.experiment import run_script

    def fail():
        raise RuntimeError("arm x: no island wrote a summary")

    def interrupted():
        raise KeyboardInterrupt

    assert run_script(lambda: None) == 0
    assert run_script(fail) == 1 and "error: arm x: no island wrote a summary" in capsys.readouterr().err
    assert run_script(interrupted) == 130 and "interrupted" in capsys.readouterr().err
