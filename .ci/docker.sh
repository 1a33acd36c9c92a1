#!/usr/bin/env bash
# CI (fresh machine): install Docker (Debian docker.io), start dockerd, build the local Python base image and both
# images on it. Idempotent: each step is skipped when already done (an image build reuses the layer cache).
# When no Docker daemon can run here: outside CI it says so and exits 0 (the docker-marked tests then skip, printing
# why); under CI=1 it exits 1, so the container suite cannot be skipped unnoticed.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG_DIR="${DOCKERD_LOG_DIR:-/tmp/rollout-matching-dockerd}"
mkdir -p "$LOG_DIR"
t0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - t0 ))s"; }
DOCKERD_WAIT_S="${DOCKERD_WAIT_S:-60}"
# No daemon: fatal in CI (CI=1/true), a warning elsewhere.
no_docker() {
  case "${CI:-}" in
    1|true|TRUE|True|yes)
      echo "docker.sh: ERROR $1; CI=${CI} requires Docker (the container tests must run)" >&2
      exit 1 ;;
  esac
  echo "docker.sh: WARNING $1; docker tests will skip" >&2
  exit 0
}

if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
  echo "docker.sh: installing docker.io and debootstrap"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >"$LOG_DIR/apt.log" 2>&1; }; then
    tail -n 20 "$LOG_DIR/apt.log" || true
    no_docker "could not install docker.io"
  fi
fi

if ! docker info >/dev/null 2>&1; then
  echo "docker.sh: starting dockerd (log: $LOG_DIR/dockerd.log)"
  nohup dockerd >"$LOG_DIR/dockerd.log" 2>&1 &
  echo $! >"$LOG_DIR/dockerd.pid"
  for _ in $(seq 1 "$DOCKERD_WAIT_S"); do
    docker info >/dev/null 2>&1 && break
    sleep 1
  done
  if ! docker info >/dev/null 2>&1; then
    tail -n 20 "$LOG_DIR/dockerd.log" || true
    no_docker "dockerd did not come up"
  fi
fi
echo "docker.sh: daemon ready after $(elapsed)"

make --no-print-directory base-image
echo "docker.sh: base image ready after $(elapsed)"
make --no-print-directory images
echo "docker.sh: images built after $(elapsed)"
