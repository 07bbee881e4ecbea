#!/usr/bin/env bash
# Install Debian's faketime (libfaketime) for the skewed-clock test unless it is already there.
# Needs root or password-less sudo; otherwise says what to do and the test is skipped with that reason.
set -euo pipefail
[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] && exit 0
if [ "$(id -u)" = 0 ]; then SUDO=(); elif sudo -n true 2>/dev/null; then SUDO=(sudo -n); else
  echo "warning: libfaketime is missing and installing it needs root: run 'sudo apt-get install faketime'" \
       "(the skewed-clock test is skipped without it)" >&2
  exit 0
fi
echo "installing Debian's faketime for the skewed-clock test" >&2
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get install -y -q faketime >/dev/null || {
  "${SUDO[@]}" apt-get update -q >/dev/null && "${SUDO[@]}" apt-get install -y -q faketime >/dev/null; }
