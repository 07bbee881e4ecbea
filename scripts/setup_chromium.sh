#!/usr/bin/env bash
# Install Debian's chromium (for the dashboard's headless browser test) unless it is already there.
# P2P_DILOCO_CHROMIUM names another Chromium binary to use instead.
set -euo pipefail
exec "$(dirname "$0")/setup_debian_package.sh" chromium "${P2P_DILOCO_CHROMIUM:-/usr/bin/chromium}" \
  "the dashboard's browser test drives it and fails without it; or set P2P_DILOCO_CHROMIUM to a Chromium binary"
