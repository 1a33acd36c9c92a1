#!/usr/bin/env bash
# Build the local Python base image (no registry pulls): debootstrap a minimal Debian from the mirror the host's
# apt sources name, add python3 + venv + pip + CA certificates, and `docker import` it.
#   images/base/build.sh [IMAGE]      (default rollout-matching/python-base:bookworm; FORCE=1 rebuilds)
set -euo pipefail
IMAGE="${1:-${BASE_IMAGE_LOCAL:-rollout-matching/python-base:bookworm}}"
DOCKER="${DOCKER:-docker}"

if [ "${FORCE:-0}" != 1 ] && $DOCKER image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "base image $IMAGE exists (FORCE=1 rebuilds)"
  exit 0
fi

# The Debian mirror and suite the host uses: deb822 sources first, then one-line sources.
debian_uri() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk '/^URIs:/ {u=$2} /^Suites:/ {for (i=2;i<=NF;i++) if ($i !~ /-(updates|security|backports)$/) s=$i}
         /^$/ {if (u ~ /debian\/?$/ && s) {print u, s; exit} u=""; s=""}
         END {if (u ~ /debian\/?$/ && s) print u, s}' "$f"
  done
  [ -f /etc/apt/sources.list ] && awk '$1=="deb" && $2 ~ /debian\/?$/ && $3 !~ /-(updates|security|backports)$/ {print $2, $3}' /etc/apt/sources.list
}
read -r MIRROR SUITE < <(debian_uri | head -n1) || true
MIRROR="${DEBIAN_MIRROR:-${MIRROR:-http://deb.debian.org/debian}}"
SUITE="${DEBIAN_SUITE:-${SUITE:-bookworm}}"
SECURITY="${MIRROR%/debian}/debian-security"

command -v debootstrap >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; }

ROOTFS="$(mktemp -d /tmp/rm-base.XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT
echo "debootstrap $SUITE from $MIRROR into $ROOTFS"
start=$(date +%s)
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
  "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 || { tail -n 40 "$ROOTFS.log"; exit 1; }
rm -f "$ROOTFS.log"

cat >"$ROOTFS/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY $SUITE-security main
SOURCES
# Smaller image: no apt lists, caches, docs or man pages (apt-get update restores the lists when needed).
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/var/log/*.log
tar -C "$ROOTFS" --numeric-owner -c . | $DOCKER import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' \
  - "$IMAGE" >/dev/null
echo "built $IMAGE in $(( $(date +%s) - start ))s: $($DOCKER run --rm "$IMAGE" python3 --version)"
