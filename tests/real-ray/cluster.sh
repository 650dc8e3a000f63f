#!/usr/bin/env bash
# A two-node Ray cluster on loopback addresses, by hand, the way the Ray
# tests run one: each `ray start --block` in its own session and process
# group, with its own temporary folder and a neuron_cores resource for the
# CPU-platform hook (vllm_warden_test_ray.py).
#
#   tests/real-ray/cluster.sh up DIR     start head and second node, wait for both
#   tests/real-ray/cluster.sh status DIR print cluster_state.py's JSON line
#   tests/real-ray/cluster.sh down DIR   stop both: SIGTERM to each process
#                                        group, then SIGKILL to what is left
#
# DIR gets head.log, node.log (the nodes' stdout and stderr), head.pid,
# node.pid and the temporary folders head/ and node/. Then, for example:
#   RAY_ADDRESS=127.0.0.3:6391 VLLM_WARDEN_TEST_RAY_DEVICE_KEY=neuron_cores \
#     vllm serve MODEL --distributed-executor-backend ray --tensor-parallel-size 2 …
# Never `ray stop`: it stops every Ray process of the machine.
#
# Addresses and ports can be moved with RAY_TEST_HEAD_IP (127.0.0.3),
# RAY_TEST_NODE_IP (127.0.0.2), RAY_TEST_PORT (6391) and
# RAY_TEST_AGENT_PORT (52367, the second node's dashboard agent: the head's
# agent holds Ray's default). 127.0.0.1 is no good: Ray replaces it with the
# machine's external address.
set -euo pipefail
cd "$(dirname "$0")/../.."
cmd=${1:?usage: cluster.sh up|status|down DIR}
dir=${2:?usage: cluster.sh up|status|down DIR}
venv=${VLLM_WARDEN_VENV:-${VLLM_WARDEN_CACHE:-/var/cache/vllm-warden-ci}/vllm-0.32.0-cpu}
head_ip=${RAY_TEST_HEAD_IP:-127.0.0.3}
node_ip=${RAY_TEST_NODE_IP:-127.0.0.2}
port=${RAY_TEST_PORT:-6391}
agent_port=${RAY_TEST_AGENT_PORT:-52367}
state=$PWD/tests/real-ray/cluster_state.py

# Starts "$@" in a new session with SIGINT and SIGQUIT at their defaults: a
# background job of a non-interactive shell would inherit them ignored.
start() {
    local name=$1; shift
    VLLM_WARDEN_TEST_RAY_DEVICE_KEY=neuron_cores RAY_USAGE_STATS_ENABLED=0 \
        "$venv/bin/python" -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
signal.signal(signal.SIGQUIT, signal.SIG_DFL)
os.setsid()
os.execv(sys.argv[1], sys.argv[1:])' "$@" >"$dir/$name.log" 2>&1 &
    echo $! >"$dir/$name.pid"
}

alive() {
    "$venv/bin/python" "$state" "$head_ip:$port" 2>/dev/null |
        "$venv/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["alive"])' 2>/dev/null || echo 0
}

wait_for() {
    local want=$1 deadline=$((SECONDS + 120))
    until [ "$(alive)" -ge "$want" ]; do
        if [ $SECONDS -ge $deadline ]; then
            echo "no $want live Ray nodes after 120 s; see $dir/*.log" >&2
            return 1
        fi
        sleep 1
    done
}

# SIGTERM to the group, up to 10 s, then SIGKILL to the group and wait
# until it is empty (the raylet's agents can outlive `ray start` by a
# minute when the GCS is gone).
stop_group() {
    local pid=$1 i
    kill -TERM -- "-$pid" 2>/dev/null || return 0
    for i in $(seq 1 100); do
        pgrep -g "$pid" >/dev/null || return 0
        sleep 0.1
    done
    kill -KILL -- "-$pid" 2>/dev/null || true
    while pgrep -g "$pid" >/dev/null; do sleep 0.1; done
}

case $cmd in
up)
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    start head "$venv/bin/ray" start --head --block --port="$port" --node-ip-address="$head_ip" \
        --num-cpus=1 --resources='{"neuron_cores": 1}' --include-dashboard=false \
        --temp-dir="$dir/head"
    wait_for 1
    start node "$venv/bin/ray" start --block --address="$head_ip:$port" --node-ip-address="$node_ip" \
        --num-cpus=1 --resources='{"neuron_cores": 1}' --dashboard-agent-listen-port="$agent_port" \
        --temp-dir="$dir/node"
    wait_for 2
    echo "head pid $(cat "$dir/head.pid"), node pid $(cat "$dir/node.pid"), RAY_ADDRESS=$head_ip:$port"
    ;;
status)
    "$venv/bin/python" "$state" "$head_ip:$port"
    ;;
down)
    for name in node head; do
        [ -f "$dir/$name.pid" ] && stop_group "$(cat "$dir/$name.pid")"
    done
    ;;
*)
    echo "usage: cluster.sh up|status|down DIR" >&2
    exit 2
    ;;
esac
