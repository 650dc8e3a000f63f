#!/usr/bin/env bash
# Engine crash -> ready, with and without [preload], on a machine with CUDA
# GPUs (not run in CI: it needs GPUs, a vLLM 0.32+ venv and a model).
#
#   tests/gpu/preload-restart.sh VLLM MODEL [SERVE ARGS...]
#   e.g. tests/gpu/preload-restart.sh /opt/vllm/bin/vllm /models/Qwen3-8B --tensor-parallel-size 2
#
# For each of the two configs (preload off, then on) it starts a warden
# (the release build, `cargo build --release`, or VLLM_WARDEN=path), waits
# until the model is ready, kills the engine's API server with SIGKILL
# (as a crash would), and times how long until the warden reports ready
# again with a new engine; then stops the warden. ROUNDS (default 3)
# crashes per config; each figure is printed, then the medians side by
# side. Everything goes in a temporary folder (kept with KEEP=1). Uses
# the port PORT (default 18000) and PORT+1 for the daemon's /health.
#
# A dry run of the script itself, without GPUs, against the simulated vLLM
# (whose engine skips its shards when it maps the weights from its daemon):
#   tests/gpu/preload-restart.sh target/release/vllm-warden-sim /srv/models/tiny --shards 8 --shard-time 500ms
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 2 ] || { sed -n 2,20p "$0" >&2; exit 2; }
vllm=$1 model=$2
shift 2
warden=${VLLM_WARDEN:-target/release/vllm-warden}
[ -x "$warden" ] || { echo "no $warden: run cargo build --release" >&2; exit 2; }
rounds=${ROUNDS:-3} port=${PORT:-18000}
tmp=$(mktemp -d -t preload-restart.XXXXXX)
[ "${KEEP:-}" = 1 ] || trap 'rm -rf "$tmp"' EXIT

since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
json() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }

# Ready with an engine other than $1 (0: any); prints the engine's pid.
wait_ready() {
    local dir=$1 not=$2 deadline=$((SECONDS + ${LOAD_CEILING:-3600}))
    while [ $SECONDS -lt $deadline ]; do
        if [ -s "$dir/status.json" ]; then
            local state pid
            state=$(json "$dir/status.json" 'd["state"]' 2>/dev/null || true)
            pid=$(json "$dir/status.json" 'd["child_pid"]' 2>/dev/null || true)
            if [ "$state" = ready ] && [ "$pid" != "$not" ] && [ "$pid" != None ]; then
                echo "$pid"
                return 0
            fi
        fi
        sleep 0.2
    done
    echo "not ready within ${LOAD_CEILING:-3600}s; see $dir" >&2
    return 1
}

run() {
    local name=$1 preload=$2 dir=$tmp/$1
    mkdir -p "$dir/state" "$dir/run" "$dir/logs"
    local args="" a
    for a in "${serve[@]}"; do args+=", \"$a\""; done
    cat >"$dir/t.toml" <<TOML
name = "$name"
[child]
command = ["$vllm", "serve", "$model", "--port", "$port"$args]
[restart]
initial-delay = "0s"
[status]
file = "$dir/status.json"
[preload]
enabled = $preload
TOML
    STATE_DIRECTORY=$dir/state RUNTIME_DIRECTORY=$dir/run LOGS_DIRECTORY=$dir/logs \
        "$warden" run -c "$dir/t.toml" 2>"$dir/warden.stderr" &
    local wpid=$! t0 pid times=()
    t0=$EPOCHREALTIME
    pid=$(wait_ready "$dir" 0)
    echo "$name: first ready after $(since "$t0") s (engine pid $pid)"
    for _ in $(seq "$rounds"); do
        t0=$EPOCHREALTIME
        kill -KILL "$pid"
        pid=$(wait_ready "$dir" "$pid")
        local took
        took=$(since "$t0")
        times+=("$took")
        echo "$name: engine crash -> ready in $took s"
    done
    kill -TERM "$wpid"
    wait "$wpid" || true
    printf '%s\n' "${times[@]}" | sort -n | sed -n "$(((rounds + 1) / 2))p" >"$tmp/$name.median"
}

serve=("$@")
run without false
run with true
echo
echo "engine crash -> ready, median of $rounds:"
echo "  without [preload]: $(cat "$tmp/without.median") s"
echo "  with [preload]:    $(cat "$tmp/with.median") s"
