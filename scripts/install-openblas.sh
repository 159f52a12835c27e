#!/usr/bin/env bash
# Installs Debian's OpenBLAS (libopenblas0-pthread) on Linux when it is missing and we may:
# as root, or with password-less sudo. Prints what it did; exits 0 when nothing can be done.
set -u
[ "$(uname -s)" = Linux ] || exit 0
arch=$(uname -m)
[ -e "/usr/lib/${arch}-linux-gnu/openblas-pthread/libblas.so.3" ] && exit 0
command -v apt-get >/dev/null || { echo "OpenBLAS not found and no apt-get: MLX will use its slow reference BLAS"; exit 0; }
if [ "$(id -u)" = 0 ]; then sudo=""; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else
  echo "OpenBLAS not installed; for ~20x faster prefill run: sudo apt-get install libopenblas0-pthread"; exit 0
fi
echo "installing libopenblas0-pthread (fast float32 matmuls for MLX on CPU)"
$sudo apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 \
  || { $sudo apt-get update -qq >/dev/null 2>&1 && $sudo apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1; } \
  || echo "could not install libopenblas0-pthread; continuing with the reference BLAS"
