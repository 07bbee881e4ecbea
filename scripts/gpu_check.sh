#!/usr/bin/env bash
# The GPU check (docs/GPU.md): unit tests, a CPU-vs-CUDA step, the small preset's tokens/s and MFU,
# an island of 2 ranks, and a 2-island swarm on the GPU for 3 minutes, bounded to 8 minutes; figures in one JSON file.
# Usage: scripts/gpu_check.sh [OUT_FOLDER]   (default runs/gpu-check; writes OUT_FOLDER/gpu_check.json)
# It uses the python3 that holds a CUDA build of torch (PYTHON=... to choose another). A machine that
# cannot reach a package registry takes the project's other dependencies as wheels in .whl/
# (pip download them where pip works); they are installed under /tmp/p2p_diloco_site.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_FOLDER="${1:-runs/gpu-check}"
PYTHON="${PYTHON:-python3}"
if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/p2p_diloco_site .whl/*.whl
  export PYTHONPATH="/tmp/p2p_diloco_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout --signal=INT --kill-after=20 470 "$PYTHON" scripts/gpu_check.py --out "$OUT_FOLDER"
