#!/usr/bin/env bash
# Installs Debian's chromium and chromium-driver for the /ui browser tests (tests/server/test_ui_browser.py) when
# they are missing and we may: as root, or with password-less sudo. Best effort, like install-openblas.sh:
# prints what it did and always exits 0; without a browser those tests skip, saying why.
set -u
[ "$(uname -s)" = Linux ] || exit 0
command -v chromium >/dev/null && command -v chromedriver >/dev/null && exit 0
command -v apt-get >/dev/null || { echo "no chromium and no apt-get: the /ui browser tests will skip"; exit 0; }
if [ "$(id -u)" = 0 ]; then sudo=""; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else
  echo "chromium not installed; for the /ui browser tests run: sudo apt-get install chromium chromium-driver"; exit 0
fi
echo "installing chromium and chromium-driver (headless browser for the /ui tests)"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 \
  || { $sudo apt-get update -qq >/dev/null 2>&1 && $sudo apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1; } \
  || echo "could not install chromium; the /ui browser tests will skip"
exit 0
