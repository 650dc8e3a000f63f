#!/usr/bin/env bash
# End-to-end on a real Ray cluster of two nodes on this machine (loopback
# addresses 127.0.0.3 and 127.0.0.2), each node under its own warden, and a
# third warden serving the tiny model with vLLM's Ray executor and tensor
# parallel 2 across both. The venv is the real-vLLM one (setup.sh adds Ray
# 2.56.1, pinned in tests/real-ray/requirements.lock, and the test-only
# import hook that lets vLLM's CPU platform use the Ray executor).
# Arguments are passed to nextest.
set -euo pipefail
cd "$(dirname "$0")/../.."
paths=$(tests/real-vllm/setup.sh)
VLLM_WARDEN_VLLM=$(sed -n 1p <<<"$paths")/bin/vllm
VLLM_WARDEN_MODELS=$(sed -n 2p <<<"$paths")
export VLLM_WARDEN_VLLM VLLM_WARDEN_MODELS
# Own temporary folder and, in a mount namespace, own /dev/shm: nothing of
# another run is mistaken for what this one leaves, and the reverse.
tmp=$(mktemp -d -t real-ray.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export TMPDIR=$tmp
run=(cargo nextest run --release --test real_ray --run-ignored only --no-capture --no-fail-fast)
unshare --mount --propagation private sh -c 'mount -t tmpfs -o mode=1777,nosuid,nodev shm /dev/shm && exec "$@"' sh "${run[@]}" "$@"
