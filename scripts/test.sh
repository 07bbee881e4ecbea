#!/usr/bin/env bash
# Create/update .venv with the test and bench extras (the benchmarks' smoke tests run torchft) and run
# the whole suite (unit + integration on 127.0.0.1).
# Extra arguments go to pytest, e.g. ./scripts/test.sh tests/unit -q
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_venv.sh test,bench
export P2P_DILOCO_CACHE="${P2P_DILOCO_CACHE:-$PWD/.cache/p2p_diloco}"
exec .venv/bin/python -m pytest "$@"
