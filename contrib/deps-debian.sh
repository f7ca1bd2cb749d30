#!/bin/sh
# Install the Debian packages stockade needs to build and test, when they are missing.
# As root: apt-get install -y of what is missing. Otherwise: say what is missing and fail.
set -eu

PKGS="gcc make pkg-config liblua5.4-dev lua5.4 libev-dev libmsgpack-dev libseccomp-dev nettle-dev lua-cjson-dev libjansson-dev \
lua-unit lua-cjson lua-check libvectorscan-dev libpcre2-dev python3-msgpack python3-pytest json-schema-test-suite iproute2 strace curl nodejs \
python3-pynvim python3-setuptools python3-pip"
[ "${1:-}" = "--with-clang" ] && PKGS="$PKGS clang"

missing=""
for p in $PKGS; do
    st=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    case "$st" in *" installed") ;; *) missing="$missing $p" ;; esac
done
# npm is its own Debian package, but part of the nodesource nodejs build: whichever is there
command -v npm >/dev/null 2>&1 || missing="$missing npm"
[ -z "$missing" ] && exit 0

if [ "$(id -u)" != 0 ]; then
    echo "stockade: missing Debian packages:$missing" >&2
    echo "stockade: run as root, or: sudo apt-get install -y$missing" >&2
    exit 1
fi
echo "stockade: installing:$missing" >&2
export DEBIAN_FRONTEND=noninteractive
# An install can fail on a stale package list; refresh once and try again.
apt-get install -y -q $missing >/dev/null 2>&1 || {
    apt-get update -q >/dev/null
    apt-get install -y -q $missing
}
