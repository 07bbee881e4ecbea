#!/usr/bin/env bash
# The main job: a local swarm (bootstrap node + islands on 127.0.0.1) training on the embedded
# Shakespeare corpus. Creates .venv if missing and installs the project first.
# Usage: ./scripts/demo.sh [--islands 3] [--minutes 3] [--preset tiny] [--out runs/NAME] (see --help)
set -euo pipefail
cd "$(dirname "$0")/.."
case " $* " in  # --help with the project installed already: no setup first
  *" --help "*|*" -h "*) [ -x .venv/bin/python ] && exec .venv/bin/python scripts/demo.py --help ;;
esac
./scripts/setup_venv.sh
exec .venv/bin/python scripts/demo.py "$@"
