#!/bin/sh
# Build stage of both images: /opt/venv on top of the base image's Python (system site-packages visible, so an
# official vLLM / PyTorch base keeps its CUDA stack), with dumb-init, an optional torch wheel from the build
# context, and the package's dependencies at the versions of LOCK (locks/gpu-runtime.txt or locks/cpu-test.txt).
#   build-venv.sh EXTRAS LOCK   (run from the directory holding pyproject.toml, install-deps.py and LOCK)
set -eu
export PIP_PROGRESS_BAR=off
EXTRAS="${1:-}"
LOCK="${2:?usage: build-venv.sh EXTRAS LOCK}"
CTX=/tmp/ctx
if [ -s "$CTX/ca.crt" ]; then
  export PIP_CERT="$CTX/ca.crt" SSL_CERT_FILE="$CTX/ca.crt" REQUESTS_CA_BUNDLE="$CTX/ca.crt"
fi
PY=python3
command -v "$PY" >/dev/null || PY=python
"$PY" -m venv --system-site-packages --without-pip /opt/venv
VPY=/opt/venv/bin/python
if ! "$VPY" -m pip --version >/dev/null 2>&1; then
  "$VPY" -m ensurepip --default-pip >/dev/null 2>&1 || { echo "the base image has no pip (install python3-pip)" >&2; exit 1; }
fi
"$VPY" -m pip install --no-cache-dir -c "$LOCK" setuptools dumb-init
for wheel in "$CTX"/wheels/torch-*.whl; do
  [ -f "$wheel" ] || continue
  echo "installing $(basename "$wheel") from the build context"
  "$VPY" -m pip install --no-cache-dir -c "$LOCK" "$wheel"
done
"$VPY" install-deps.py pyproject.toml "$LOCK" "$EXTRAS" --no-build-isolation
