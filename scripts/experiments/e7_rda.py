#!/usr/bin/env python3
"""E7: radial-directional averaging (RDA) vs the token-weighted mean, with 4 and 8 islands.

Decoupled DiLoCo (arXiv 2604.21428): averaging unit directions and norms separately keeps the
merged update's size when islands' updates point in different directions (the plain mean shrinks
it), which matters more with more islands.

Arms (STEPS steps per island; 8 islands share the 2 cores, so their period is longer for a similar H):
  mean-4, rda-4, mean-8, rda-8

    .venv/bin/python scripts/experiments/e7_rda.py [--steps 150]
"""

from _common import Arm, main


def build(steps: int):
    return [Arm(f"{merge}-{n}", n, steps, ["--outer-merge", merge], period=12.0 * n / 4)
            for n in (4, 8) for merge in ("mean", "rda")]


if __name__ == "__main__":
    raise SystemExit(main("e7", "E7: RDA vs mean with 4 and 8 islands", build, 150, __doc__))
