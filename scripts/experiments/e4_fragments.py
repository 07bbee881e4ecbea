#!/usr/bin/env python3
"""E4: fragments P=1 vs P=4 with overlapped communication.

Streaming DiLoCo (arXiv 2501.18512, Sec. 3): syncing one of P fragments at a time, overlapped with
inner steps, keeps the loss of plain DiLoCo while the peak bytes per step drop about P times.

Arms (4 islands, STEPS steps each, the same outer period, so the same H for every fragment):
  P=1          plain DiLoCo: the whole model in every round
  P=4          four fragments on staggered slots; a round's result lands with the progress made
               meanwhile carried on top (overlap)
  P=4,mix      as P=4, but landing as alpha*local + (1-alpha)*global with alpha = 0.5 (the paper's mix)

    .venv/bin/python scripts/experiments/e4_fragments.py [--steps 200]
"""

from _common import Arm, main

PERIOD = 24.0  # P=4 needs T/P above matchmaking + grace + all-reduce


def build(steps: int):
    return [
        Arm("P=1", 4, steps, ["--outer-fragments", "1"], period=PERIOD),
        Arm("P=4", 4, steps, ["--outer-fragments", "4"], period=PERIOD),
        Arm("P=4,mix", 4, steps, ["--outer-fragments", "4", "--outer-apply", "mix", "--outer-alpha", "0.5"],
            period=PERIOD),
    ]


if __name__ == "__main__":
    raise SystemExit(main("e4", "E4: fragments P=1 vs P=4 (overlapped)", build, 200, __doc__))
