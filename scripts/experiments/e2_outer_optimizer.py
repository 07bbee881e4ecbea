#!/usr/bin/env python3
"""E2: the outer optimizer: Nesterov momentum 0.9 and 0.7 vs plain averaging (FedAvg).

DiLoCo (arXiv 2311.08105, Sec. 3.3, Table 3): Nesterov outer momentum beats plain averaging.

Arms (4 islands, STEPS steps each, equal tokens):
  nesterov-0.9   outer SGD lr 0.7, Nesterov momentum 0.9 (the default)
  nesterov-0.7   outer SGD lr 0.7, Nesterov momentum 0.7
  fedavg         outer lr 1, momentum 0: Theta becomes the (token-weighted) average of the islands

    .venv/bin/python scripts/experiments/e2_outer_optimizer.py [--steps 200]
"""

from _common import Arm, main


def build(steps: int):
    return [
        Arm("nesterov-0.9", 4, steps),
        Arm("nesterov-0.7", 4, steps, ["--outer-momentum", "0.7"]),
        Arm("fedavg", 4, steps, ["--outer-lr", "1.0", "--outer-momentum", "0"]),
    ]


if __name__ == "__main__":
    raise SystemExit(main("e2", "E2: Nesterov outer momentum vs plain averaging", build, 200, __doc__))
