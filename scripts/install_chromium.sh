#!/usr/bin/env bash
# Install Debian's chromium for the browser tests (tests/browser), if it is not there yet.
# Quiet; run as root (CI containers) or with sudo available.
set -euo pipefail
[ -x /usr/bin/chromium ] && exit 0
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "install_chromium.sh: not root and no sudo; run as root" >&2; exit 1; }
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -qq chromium >/dev/null 2>&1 || {
    $SUDO apt-get update -qq >/dev/null
    $SUDO apt-get install -y -qq chromium >/dev/null
}
[ -x /usr/bin/chromium ] || { echo "install_chromium.sh: /usr/bin/chromium still missing" >&2; exit 1; }
