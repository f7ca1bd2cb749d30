#!/bin/sh
# Install the Debian packages stockade needs to build and test, when they are missing.
# As root: apt-get install -y of what is missing. Otherwise: say what is missing and fail.
#   --with-clang   also what `make fuzz` needs
#   --with-deb     also what `make deb` and .ci/deb-smoke need
# Works on Debian 12, Debian 13 and Ubuntu 24.04 (msgpack-c's -dev package changed name).
set -eu

PKGS="gcc make pkg-config liblua5.4-dev lua5.4 libev-dev libseccomp-dev nettle-dev lua-cjson-dev \
libjansson-dev libvectorscan-dev libpcre2-dev libsystemd-dev scdoc lua-unit lua-cjson \
lua-check python3-msgpack python3-pytest json-schema-test-suite iproute2 strace curl nodejs \
python3-pynvim python3-setuptools python3-pip"
for arg in "$@"; do
    case $arg in
        --with-clang) PKGS="$PKGS clang" ;;
        --with-deb) PKGS="$PKGS debhelper dpkg-dev lintian systemd man-db bash-completion" ;;
    esac
done

installed() {
    case "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)" in
        *" installed") return 0 ;;
    esac
    return 1
}

# msgpack-c: libmsgpack-dev on Debian 12, libmsgpack-c-dev on Debian 13 / Ubuntu 24.04
if ! installed libmsgpack-c-dev && ! installed libmsgpack-dev; then
    if apt-cache show libmsgpack-c-dev >/dev/null 2>&1; then
        PKGS="$PKGS libmsgpack-c-dev"
    else
        PKGS="$PKGS libmsgpack-dev"
    fi
fi

missing=""
for p in $PKGS; do
    installed "$p" || missing="$missing $p"
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
