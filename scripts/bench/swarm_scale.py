#!/usr/bin/env python3
"""How a swarm of lightweight islands behaves as it grows: rounds, group formation, DHT records and
the bootstrap node's load at 4 to 32 islands. What is measured and how: p2p_diloco/lab/scale.py;
figures: docs/SCALE.md.

    .venv/bin/python scripts/bench/swarm_scale.py --islands 4 8 16 32 --rounds 10 --out runs/bench/scale
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from p2p_diloco.lab.scale import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
