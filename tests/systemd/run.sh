#!/usr/bin/env bash
# End-to-end test under a real systemd (PID 1 of a systemd-nspawn container)
# with real journald: builds the .deb, installs it in a clean container and
# drives vllm-warden@NAME with systemctl and journalctl, as an operator does
# (tests/systemd/inside.sh). Needs root, systemd-container and debootstrap.
set -euo pipefail
cd "$(dirname "$0")/../.."

# The shipped unit's exposure score, gated (systemd-analyze: 0 best, 10 worst).
threshold=25
echo "systemd-analyze security (offline), gate ${threshold%?}.${threshold: -1}:"
systemd-analyze security --offline=true --threshold=$threshold systemd/vllm-warden@.service | tail -n 1

payload=$(mktemp -d)
chmod 755 "$payload"
deb=$(packaging/build-deb.sh | tail -n 1)
echo "package: $deb"
cp "$deb" "$payload/vllm-warden.deb"
# The same build as a later package version, to upgrade to.
version=$(cargo metadata --no-deps --format-version 1 | sed 's/.*"name":"vllm-warden","version":"\([^"]*\)".*/\1/')
next=$(packaging/build-deb.sh --no-build --deb-version "$version+next" | tail -n 1)
echo "next package: $next"
cp "$next" "$payload/vllm-warden-next.deb"
rootfs=$(tests/systemd/rootfs.sh)
# The real vLLM (venv and tiny model) of tests/real-vllm/, made or checked
# by its setup, shown to the container read-only at the same paths.
{ read -r venv; read -r models; } < <(tests/real-vllm/setup.sh)

cp tests/systemd/lib.sh tests/systemd/inside.sh tests/systemd/real-vllm.sh tests/systemd/load.py "$payload/"
cp examples/ray/vllm-warden@kimi.service.d/ray.conf "$payload/ray.conf"
chmod 644 "$payload"/*

machine=vwtest-$$
systemd-nspawn --boot --directory="$rootfs" --machine="$machine" --volatile=overlay \
    --register=no --keep-unit --console=read-only --bind-ro="$payload:/opt/payload" \
    --bind-ro="$venv" --bind-ro="$models" \
    >"$payload/console.log" 2>&1 &
nspawn=$!

cleanup() {
    local rc=$?
    if [ -n "${leader:-}" ]; then
        nsenter --target "$leader" --all systemctl poweroff >/dev/null 2>&1 || true
    fi
    # The container shuts down within seconds; then it is killed.
    timeout 30 tail --pid="$nspawn" -f /dev/null || kill -9 "$nspawn" 2>/dev/null || true
    if [ "$rc" -ne 0 ]; then
        echo "--- container console"; tail -n 50 "$payload/console.log" || true
    fi
    rm -rf "$payload"
    exit "$rc"
}
trap cleanup EXIT

# The container's PID 1 is the systemd child of systemd-nspawn.
leader=""
for _ in $(seq 300); do
    leader=$(pgrep -P "$nspawn" -x systemd || true)
    [ -n "$leader" ] && break
    sleep 0.1
done
[ -n "$leader" ] || { echo "the container did not boot"; exit 1; }

rc=0
nsenter --target "$leader" --all timeout 600 bash /opt/payload/inside.sh || rc=1
# The operator's quickstart against the real vLLM: four loads, the first
# compiling (a minute or two each on 2 cores). VLLM_WARDEN_E2E_SIM_ONLY=1
# leaves it out, for a quick run of the checks above.
if [ -z "${VLLM_WARDEN_E2E_SIM_ONLY:-}" ]; then
    nsenter --target "$leader" --all timeout 1800 bash /opt/payload/real-vllm.sh "$venv" "$models/tiny" || rc=1
fi
exit $rc
