#!/usr/bin/env python3
"""How long one averaging round takes: this project's hivemind averager against gloo and a memory
copy. What is timed and how: p2p_diloco/lab/allreduce.py; figures: docs/BENCHMARKS.md.

    .venv/bin/python scripts/bench/allreduce.py --sizes-mb 1 16 64 --peers 2 4 --repeats 5
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from p2p_diloco.lab.allreduce import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
