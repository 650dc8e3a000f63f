#!/usr/bin/env bash
# Run a command under the kernel settings that systemd applies at boot on
# every distribution the warden targets (systemd's sysctl.d/50-default.conf
# and 50-pid-max.conf), then put back what was there, however the command
# ends. A host booted without systemd (a container, a CI machine) keeps the
# kernel's own defaults, and a test can pass there and fail on every
# workstation and server: the datagram queue of a unix socket is 10 long by
# the kernel and 512 by systemd; /tmp refuses some opens of another user's
# files and FIFOs only with fs.protected_*.
#
# Usage (root): tests/host-sysctls.sh systemd|kernel CMD [ARG…]
#   systemd: the values below; kernel: the kernel's defaults for the same
#   keys. Exits with CMD's status.
set -uo pipefail

[ $# -ge 2 ] || { echo "usage: $0 systemd|kernel CMD [ARG…]" >&2; exit 2; }
profile=$1
shift

keys=(net.unix.max_dgram_qlen fs.protected_regular fs.protected_fifos fs.protected_symlinks fs.protected_hardlinks kernel.pid_max)
case $profile in
    systemd) values=(512 1 1 1 1 4194304) ;;
    kernel) values=(10 0 0 0 0 "$(( $(nproc) * 1024 > 32768 ? $(nproc) * 1024 : 32768 ))") ;;
    *) echo "$0: no profile '$profile' (systemd or kernel)" >&2; exit 2 ;;
esac

saved=()
for key in "${keys[@]}"; do
    saved+=("$(sysctl -n "$key")") || exit 1
done
restore() {
    local i
    for i in "${!keys[@]}"; do
        sysctl -q -w "${keys[$i]}=${saved[$i]}" || echo "$0: could not put back ${keys[$i]}=${saved[$i]}" >&2
    done
}
trap restore EXIT
trap 'exit 130' INT TERM

shown=()
for i in "${!keys[@]}"; do
    sysctl -q -w "${keys[$i]}=${values[$i]}" || exit 1
    shown+=("${keys[$i]}=${values[$i]}")
done
echo "=== $profile sysctls: ${shown[*]}"
"$@"
