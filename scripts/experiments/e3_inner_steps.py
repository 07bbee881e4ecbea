#!/usr/bin/env python3
"""E3: inner steps per outer period H in {10, 50, 200}.

DiLoCo (arXiv 2311.08105, Sec. 3.2, Fig. 4): fewer synchronisations degrade quality mildly and
monotonically.

Rounds run on a wall-clock period (docs/DESIGN.md, "When rounds happen"), so H is set through the period: islands are slowed
to about STEP_SECONDS per inner step (--slowdown) and the period is H x STEP_SECONDS; the table
reports the measured H. One fragment (plain DiLoCo), 2 islands, 2 x STEPS steps each.

    .venv/bin/python scripts/experiments/e3_inner_steps.py [--steps 200]
"""

from _common import Arm, main

STEP_SECONDS = 0.7
FAST_ROUNDS = ["--outer-fragments", "1", "--outer-matchmaking-time", "1.0", "--outer-grace-window", "0.3",
               "--outer-allreduce-timeout", "1.5", "--outer-request-timeout", "0.4", "--slowdown", "2"]


def build(steps: int):
    return [Arm(f"H={h}", 2, 2 * steps, FAST_ROUNDS, period=h * STEP_SECONDS) for h in (10, 50, 200)]


if __name__ == "__main__":
    raise SystemExit(main("e3", "E3: inner steps per outer period H", build, 200, __doc__))
