#!/usr/bin/env bash
# Build (once) a minimal Debian 12 root filesystem with systemd, for booting
# with systemd-nspawn. Cached outside the repository; prints its path.
# Besides systemd: Debian's python3 (the interpreter of the real-vLLM venv
# that the container's service user runs), what torch inductor needs to
# compile on the CPU (g++, python3-dev for Python.h, openssl, which it runs)
# and libnuma1 (vLLM's CPU backend). A cache made with another package list
# is made again.
set -euo pipefail
cache=${VLLM_WARDEN_CACHE:-/var/cache/vllm-warden-ci}
rootfs=$cache/rootfs-bookworm
packages=systemd,systemd-sysv,dbus,libpam-systemd,procps,python3,python3-dev,g++,libnuma1,openssl,curl
stamp=$rootfs/.complete-$(echo "$packages" | sha256sum | cut -c1-16)
if [ -x "$rootfs/lib/systemd/systemd" ] && [ -f "$stamp" ]; then
    echo "$rootfs"
    exit 0
fi
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
mirror=${mirror:-http://deb.debian.org/debian}
rm -rf "$rootfs"
mkdir -p "$cache"
debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror" >&2
touch "$stamp"
echo "$rootfs"
