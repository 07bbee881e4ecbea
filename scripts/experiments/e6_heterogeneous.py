#!/usr/bin/env python3
"""E6: heterogeneous islands: quorum K=M vs K=1 vs K=1 with a grace window.

Decoupled DiLoCo (arXiv 2604.21428): with a minimum quorum of one and a grace window, learners
never wait, goodput stays at 100% and quality matches waiting for everyone.

4 islands; islands 2 and 3 are 20% slower (--slowdown 1.2), every island's step time jitters by
+-20%. Arms (STEPS steps each):
  K=4         a round waits up to the grace window (1.5 s) for all four
  K=1         a round takes whoever is there at its slot (hivemind needs two: a lone island falls back)
  K=1,grace   as K=1, but a lone island waits up to 1.5 s past the slot for a partner

    .venv/bin/python scripts/experiments/e6_heterogeneous.py [--steps 200]
"""

from _common import Arm, main

SLOW = {2: ["--slowdown", "1.2"], 3: ["--slowdown", "1.2"]}
JITTER = ["--slowdown-jitter", "0.2"]


def build(steps: int):
    return [
        Arm("K=4", 4, steps, [*JITTER, "--outer-quorum", "4", "--outer-grace-window", "1.5"], SLOW),
        Arm("K=1", 4, steps, [*JITTER, "--outer-quorum", "1", "--outer-grace-window", "0"], SLOW),
        Arm("K=1,grace", 4, steps, [*JITTER, "--outer-quorum", "1", "--outer-grace-window", "1.5"], SLOW),
    ]


if __name__ == "__main__":
    raise SystemExit(main("e6", "E6: heterogeneous islands, quorum and grace window", build, 200, __doc__))
