#!/usr/bin/env python3
"""E1: 4 islands vs 1 island vs data-parallel with 4x the batch, at equal tokens.

DiLoCo (arXiv 2311.08105, Sec. 3): M replicas with an outer Nesterov step beat one replica and come
close to (or beat) data-parallel training with M times the batch, for the same tokens.

Arms (same model, data and tokens: 4 x STEPS x 2048):
  diloco-4   4 islands, STEPS inner steps each, default outer loop (Nesterov 0.7/0.9, P=2)
  single     1 island, 4 x STEPS steps, the same outer loop on its own pseudo-gradient
  dp-4x      1 island, STEPS steps of a 4x batch (64 sequences), outer lr 1 and momentum 0: the outer
             step is the identity, so this is plain training with the data-parallel batch

    .venv/bin/python scripts/experiments/e1_replicas.py [--steps 200]
"""

from _common import Arm, main


def build(steps: int):
    return [
        Arm("diloco-4", 4, steps),
        # one island runs faster than each of four sharing two cores: a shorter period keeps H closer
        Arm("single", 1, 4 * steps, period=9.0),
        Arm("dp-4x", 1, steps, ["--inner-batch-size", "64", "--outer-lr", "1.0", "--outer-momentum", "0"]),
    ]


if __name__ == "__main__":
    raise SystemExit(main("e1", "E1: 4 islands vs 1 island vs data-parallel (4x batch), equal tokens", build, 200, __doc__))
