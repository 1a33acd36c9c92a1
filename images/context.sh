#!/usr/bin/env bash
# Prepare build/docker-context/ (copied into the images' build stage only):
#   ca.crt        the CA bundle pip uses on this host (PIP_CERT, pip's `cert` setting, or the system bundle),
#                 so pip inside the build trusts the same TLS chain as pip here;
#   wheels/       optional wheels, e.g. the CPU torch wheel for images built on the local Python base.
# Prints the PyPI index URL pip uses here (empty for the default), for --build-arg PIP_INDEX_URL.
#   images/context.sh [WHEEL...]
set -euo pipefail
CTX=build/docker-context
rm -rf "$CTX"
mkdir -p "$CTX/wheels"
pip_setting() { python3 -m pip config list 2>/dev/null | sed -n "s/^[^.]*\.$1='\(.*\)'$/\1/p" | head -n1; }
ca="${PIP_CERT:-$(pip_setting cert)}"
[ -n "$ca" ] && [ -f "$ca" ] || ca=/etc/ssl/certs/ca-certificates.crt
if [ -f "$ca" ]; then cp "$ca" "$CTX/ca.crt"; else : >"$CTX/ca.crt"; fi
for wheel in "$@"; do
  [ -f "$wheel" ] || { echo "wheel not found: $wheel" >&2; exit 1; }
  ln -f "$wheel" "$CTX/wheels/" 2>/dev/null || cp "$wheel" "$CTX/wheels/"
done
index="${PIP_INDEX_URL:-$(pip_setting index-url)}"
case "$index" in http://*|https://*) echo "$index" ;; *) echo "" ;; esac
