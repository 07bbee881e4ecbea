#!/usr/bin/env bash
# Create/update .venv with the test, data, bench, wandb and tensorboard extras (parquet and datasets folders; the benchmarks' smoke tests run
# torchft; the logging tests write offline W&B runs and TensorBoard files), install Debian's chromium for
# the dashboard's browser test, faketime and iptables for the clock and NAT tests, and run the whole suite (unit + integration on 127.0.0.1).
# Extra arguments go to pytest, e.g. ./scripts/test.sh tests/unit -q
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_venv.sh test,data,bench,wandb,tensorboard
./scripts/setup_chromium.sh  # the dashboard's browser test drives Debian's chromium
./scripts/setup_debian_package.sh faketime /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 \
  "the skewed-clock test moves islands' wall clocks with it and is skipped without it"
./scripts/setup_debian_package.sh iptables /usr/sbin/iptables \
  "the NAT test's routers masquerade with it and the test is skipped without it"
export P2P_DILOCO_CACHE="${P2P_DILOCO_CACHE:-$PWD/.cache/p2p_diloco}"
# bytecode once, for the hundreds of processes the tests start (with PYTHONDONTWRITEBYTECODE set, each
# would compile the package again)
.venv/bin/python -m compileall -q p2p_diloco tests scripts || true  # (a file that does not compile: pytest says which)
exec .venv/bin/python -m pytest "$@"
