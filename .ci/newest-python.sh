#!/usr/bin/env bash
# The newest-jax lane: a command on the newest Python and the jax that pip picks for it today,
# on a machine whose own Python is 3.11 (where pip stops at jax 0.10.2; jax 0.11 and later need
# Python >= 3.12).
#
#   .ci/newest-python.sh setup          # once per machine: a Debian 13 root with Python 3.13
#   .ci/newest-python.sh run 'CMD'      # CMD in bash, on Python 3.13, in a fresh copy of this
#                                       # work tree (what `git ls-files` lists plus untracked,
#                                       # unignored files; no .venv, no build output)
#
# The root lives at $NEWEST_PY_ROOT (default /opt/newest-python) and is kept between runs on the
# same machine (pip's cache too), so only the first run pays for debootstrap (about 2 minutes).
# Each `run` works in its own copy of the tree (the system mounts are shared), so two runs (say,
# CI and one test file) can go on side by side, and a virtual environment made by CMD never
# clashes with the host's own .venv. Setting the root up and its mounts happen under a lock.
# Needs root (debootstrap, chroot, bind mounts) and Debian's package registry; pip inside uses
# PyPI directly (the host's pip configuration is not copied in).
set -euo pipefail
ROOT=${NEWEST_PY_ROOT:-/opt/newest-python}
SUITE=${NEWEST_PY_SUITE:-trixie}
repo=$(cd "$(dirname "$0")/.." && pwd)

unmount_all() {  # every mount below $ROOT, deepest first, so nothing below it is deleted
  local m
  for m in $(awk -v r="$ROOT" '$2 == r || index($2, r "/") == 1 {print $2}' /proc/mounts | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
}

setup() {
  [ -x "$ROOT/usr/bin/python3" ] && [ -f "$ROOT/.ready" ] && return 0
  command -v debootstrap >/dev/null || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
  # The Debian mirror the host's apt uses (a deb822 URIs line, or a one-line deb entry).
  local mirror
  mirror=$( (sed -n 's/^URIs: *\([^ ]*\/debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null
             sed -n 's/^deb \(\[[^]]*\] \)\{0,1\}\([^ ]*\/debian\) .*/\2/p' /etc/apt/sources.list 2>/dev/null
             true) | head -1)
  [ -n "$mirror" ] || { echo "newest-python: no Debian mirror in the host's apt sources" >&2; exit 1; }
  echo "newest-python: making a Debian $SUITE root at $ROOT" >&2
  # A root left half-made keeps bind mounts of the host's /dev, /proc, /sys: unmount them first,
  # and never cross into another file system while deleting.
  unmount_all
  rm -rf --one-file-system "$ROOT"
  debootstrap --variant=minbase "$SUITE" "$ROOT" "$mirror" >/dev/null
  system_mounts
  chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    bash -c "apt-get update -qq && apt-get install -y -qq python3 python3-venv python3-dev gcc g++ git ca-certificates >/dev/null"
  touch "$ROOT/.ready"
}

system_mounts() {
  local d
  for d in proc sys dev dev/pts; do
    mkdir -p "$ROOT/$d"
    mountpoint -q "$ROOT/$d" || mount --bind "/$d" "$ROOT/$d"
  done
  mkdir -p "$ROOT/dev/shm"
  mountpoint -q "$ROOT/dev/shm" || mount -t tmpfs tmpfs "$ROOT/dev/shm"
  # pip inside must trust what the host's pip trusts and resolve names as the host does. A new
  # minbase root has no /etc/ssl/certs until its ca-certificates package is installed, after
  # these mounts: -D makes the directory.
  install -D -m 644 /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
  install -m 644 /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
  # gloo (jax's CPU collectives, the multi-process tests) resolves this machine's host name.
  install -m 644 /etc/hosts "$ROOT/etc/hosts" 2>/dev/null || true
}

copy_tree() {  # the work tree as git sees it (tracked + untracked, unignored, present), into $1
  mkdir -p "$1"
  (cd "$repo" && git ls-files -z --cached --others --exclude-standard \
     | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
     | tar --null -T - -cf -) | tar -xf - -C "$1"
  # A git checkout, so that tools that ask git (setuptools, the tests) find one.
  (cd "$1" && git init -q && git add -A >/dev/null 2>&1 \
     && git -c user.name=ci -c user.email=ci@localhost commit -qm tree >/dev/null 2>&1 || true)
}

run() {
  local cmd=$1 lane
  mkdir -p "$(dirname "$ROOT")"
  exec 9>"$ROOT.lock"
  flock 9
  setup
  system_mounts
  flock -u 9
  lane="lanes/$$"
  trap 'rm -rf --one-file-system "${ROOT:?}/'"$lane"'"' EXIT
  rm -rf --one-file-system "${ROOT:?}/$lane"
  copy_tree "$ROOT/$lane"
  chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \
    CI="${CI:-}" PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    PIP_DEFAULT_TIMEOUT=180 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    bash -c "cd /$lane && $cmd"
}

case "${1:-}" in
  setup) mkdir -p "$(dirname "$ROOT")"; exec 9>"$ROOT.lock"; flock 9; setup ;;
  run) shift; [ $# -eq 1 ] || { echo "usage: $0 run 'COMMAND'" >&2; exit 2; }; run "$1" ;;
  *) sed -n '2,17p' "$0" >&2; exit 2 ;;
esac
