#!/usr/bin/env bash
# Install Debian's chromium (for the dashboard's headless browser test) unless it is already there.
# Needs root or password-less sudo; otherwise says what to do and leaves the test to fail clearly.
set -euo pipefail
CHROMIUM="${P2P_DILOCO_CHROMIUM:-/usr/bin/chromium}"
[ -x "$CHROMIUM" ] && exit 0
if [ "$(id -u)" = 0 ]; then SUDO=(); elif sudo -n true 2>/dev/null; then SUDO=(sudo -n); else
  echo "warning: $CHROMIUM is missing and installing it needs root: run 'sudo apt-get install chromium'" \
       "(or set P2P_DILOCO_CHROMIUM to a Chromium binary); the browser test fails without it" >&2
  exit 0
fi
echo "installing Debian's chromium for the browser test" >&2
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get install -y -q chromium >/dev/null || {
  "${SUDO[@]}" apt-get update -q >/dev/null && "${SUDO[@]}" apt-get install -y -q chromium >/dev/null; }
