#!/usr/bin/env bash
# Makes a redis-server available to the tests (router KV events): the one on PATH if any, else Debian's
# package unpacked into $venv/redis (apt-get download + dpkg -x: no root, nothing installed system-wide).
#   bash scripts/fetch_redis.sh [VENV]     prints the redis-server path
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-${RADIXRELAY_VENV:-.venv}}"
dest="$venv/redis"
if command -v redis-server >/dev/null 2>&1; then command -v redis-server; exit 0; fi
if [ -x "$dest/usr/bin/redis-server" ]; then echo "$dest/usr/bin/redis-server"; exit 0; fi
if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg >/dev/null 2>&1; then
    echo "radixrelay setup: no redis-server on PATH and no apt-get/dpkg to fetch Debian's; install redis-server" >&2
    exit 1
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
download() { (cd "$tmp" && apt-get download -q redis-server redis-tools liblzf1 libjemalloc2 >/dev/null 2>&1); }
if ! download; then
    # a fresh image may have no package lists: fetch them (root only), then try again
    if [ "$(id -u)" = 0 ]; then apt-get update -qq >/dev/null 2>&1 || true; fi
    download || { echo "radixrelay setup: apt-get download redis-server failed (try: apt-get update)" >&2; exit 1; }
fi
mkdir -p "$dest"
for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$dest"; done
echo "$dest/usr/bin/redis-server"
