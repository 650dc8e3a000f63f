#!/usr/bin/env bash
# The GPU rows of the fault catalogue (docs/operator-guide.md, "The fault
# catalogue"), on a machine with an NVIDIA GPU (not run in CI: it needs a
# GPU, a vLLM 0.32+ venv, a model and root, for the kernel's log).
#
#   tests/gpu/faults.sh VLLM MODEL
#
# It starts a warden (the release build, or VLLM_WARDEN=path) serving MODEL
# on GPU 0 with the golden check on and the shipped kernel-message source,
# waits until it is ready, then:
#   1. xid-recheck: a CUDA program of its own on the same GPU writes through
#      a null pointer; the driver logs a real Xid (13 or 31) for that
#      program's context; the warden must take the model out of rotation
#      (`STATUS=rechecking`), ask its answers again and put it back
#      (`back in rotation after`); it prints both delays from the kernel
#      line's timestamp.
#   2. gpu-memory-after-stop: it stops the warden and times until
#      `nvidia-smi --query-compute-apps` lists no process of the tree: the
#      next start's GPU wait (prestart.gpu-idle-wait) is what guards it.
# A fatal Xid (48, 79, …) cannot be caused on purpose: that row stays "not
# run" until a failing GPU is at hand.
set -euo pipefail
VLLM=${1:?VLLM}; MODEL=${2:?MODEL}
WARDEN=${VLLM_WARDEN:-$(dirname "$0")/../../target/release/vllm-warden}
PORT=${PORT:-18100}
d=$(mktemp -d); trap 'kill "$wpid" 2>/dev/null || true; [ -n "${KEEP:-}" ] || rm -rf "$d"' EXIT
cat >"$d/t.toml" <<TOML
name = "gpu-faults"
[child]
command = ["$VLLM", "serve", "$MODEL", "--port", "$PORT"]
env = { CUDA_VISIBLE_DEVICES = "0" }
log-file = "$d/t.log"
[status]
file = "$d/status.json"
[golden]
enabled = true
TOML
STATE_DIRECTORY=$d/state "$WARDEN" run -c "$d/t.toml" 2>"$d/warden.stderr" & wpid=$!
state() { grep -o '"state": "[a-z]*"' "$d/status.json" 2>/dev/null | grep -o '[a-z]*"$' | tr -d '"'; }
until [ "$(state)" = ready ]; do kill -0 "$wpid"; sleep 1; done
echo "ready"

# 1. xid-recheck
t0=$(date +%s.%N)
"$(dirname "$VLLM")/python3" - <<'PY' || true
import ctypes, torch
torch.cuda.init()
# A kernel that writes through a null pointer: an MMU fault of this
# process's context (Xid 31), the server's own context untouched.
from torch.utils.cpp_extension import load_inline
m = load_inline("nullwrite", cpp_sources="void go();", cuda_sources="""
__global__ void k(int *p) { *p = 1; }
void go() { k<<<1, 1>>>((int*)0); cudaDeviceSynchronize(); }
""", functions=["go"])
m.go()
PY
until grep -q 'back in rotation after\|run failed' "$d/warden.stderr"; do kill -0 "$wpid"; sleep 0.2; done
grep -E 'kernel: GPU fault: Xid|rechecking pid|back in rotation after|run failed' "$d/warden.stderr"
echo "xid-recheck: from $t0; see the lines above for the Xid, out of rotation and back"

# 2. gpu-memory-after-stop
kill -TERM "$wpid"; wait "$wpid" || true
t1=$(date +%s.%N)
until [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ]; do sleep 0.2; done
echo "gpu-memory-after-stop: GPU free $(echo "$(date +%s.%N) - $t1" | bc) s after the warden exited"
