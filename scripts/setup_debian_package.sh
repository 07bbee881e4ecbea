#!/usr/bin/env bash
# Install a Debian package a test needs unless the file that shows it is installed exists.
# Usage: scripts/setup_debian_package.sh PACKAGE FILE PURPOSE
# Needs root or password-less sudo; otherwise says what to do (PURPOSE says what goes without it).
set -euo pipefail
PACKAGE="$1" FILE="$2" PURPOSE="$3"
[ -e "$FILE" ] && exit 0
if [ "$(id -u)" = 0 ]; then SUDO=(); elif sudo -n true 2>/dev/null; then SUDO=(sudo -n); else
  echo "warning: $FILE is missing and installing it needs root: run 'sudo apt-get install $PACKAGE'" \
       "($PURPOSE)" >&2
  exit 0
fi
echo "installing Debian's $PACKAGE ($PURPOSE)" >&2
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get install -y -q "$PACKAGE" >/dev/null || {
  "${SUDO[@]}" apt-get update -q >/dev/null && "${SUDO[@]}" apt-get install -y -q "$PACKAGE" >/dev/null; }
