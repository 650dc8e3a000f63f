#!/usr/bin/env bash
# Build (once) a minimal Debian 12 root filesystem with systemd, for booting
# with systemd-nspawn. Cached outside the repository; prints its path.
set -euo pipefail
cache=${VLLM_WARDEN_CACHE:-/var/cache/vllm-warden-ci}
rootfs=$cache/rootfs-bookworm
if [ -x "$rootfs/lib/systemd/systemd" ] && [ -f "$rootfs/.complete" ]; then
    echo "$rootfs"
    exit 0
fi
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
mirror=${mirror:-http://deb.debian.org/debian}
rm -rf "$rootfs"
mkdir -p "$cache"
debootstrap --variant=minbase --include=systemd,systemd-sysv,dbus,libpam-systemd,procps \
    bookworm "$rootfs" "$mirror" >&2
touch "$rootfs/.complete"
echo "$rootfs"
