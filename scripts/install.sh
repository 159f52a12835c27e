#!/usr/bin/env bash
# Best-effort Debian/Ubuntu installs for `make setup`, each only when missing and allowed (as root, or with
# password-less sudo); prints what it did and exits 0 whatever happens:
#   install.sh openblas   libopenblas0-pthread: fast float32 matmuls for MLX on the CPU
#   install.sh chromium   chromium + chromium-driver: the /ui browser tests (tests/server/test_ui_browser.py)
set -u
case "${1:-}" in
  openblas)
    [ -e "/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libblas.so.3" ] && exit 0
    packages="libopenblas0-pthread" why="fast float32 matmuls for MLX on the CPU"
    without="MLX will use its slow reference BLAS" manual="for ~20x faster prefill run";;
  chromium)
    command -v chromium >/dev/null && command -v chromedriver >/dev/null && exit 0
    packages="chromium chromium-driver" why="headless browser for the /ui tests"
    without="the /ui browser tests will skip (fail where CI=true)" manual="for the /ui browser tests run";;
  *) echo "usage: install.sh openblas|chromium" >&2; exit 2;;
esac
[ "$(uname -s)" = Linux ] || exit 0
command -v apt-get >/dev/null || { echo "$packages not found and no apt-get: $without"; exit 0; }
if [ "$(id -u)" = 0 ]; then sudo=""; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else
  echo "$packages not installed; $manual: sudo apt-get install $packages"; exit 0
fi
echo "installing $packages ($why)"
export DEBIAN_FRONTEND=noninteractive
# shellcheck disable=SC2086  # $packages is a list of words
$sudo apt-get install -y -qq $packages >/dev/null 2>&1 \
  || { $sudo apt-get update -qq >/dev/null 2>&1 && $sudo apt-get install -y -qq $packages >/dev/null 2>&1; } \
  || echo "could not install $packages; $without"
exit 0
