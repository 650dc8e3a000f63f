#!/usr/bin/env bash
# Runs inside the container, as root, with systemd as PID 1. Every check
# prints "ok - …" or "not ok - …"; the last line counts them.
set -uo pipefail
. "$(dirname "$0")/lib.sh"
finish() { echo "systemd e2e: $passed passed, $failed failed"; [ "$failed" -eq 0 ]; exit $?; }
trap finish EXIT
child_pid() { grep -o '"child_pid": [0-9]*' "/run/vllm-warden/$1/status.json" 2>/dev/null | grep -o '[0-9]*$'; }
# Ready, with a child other than $2 (read before and after: the same one).
ready_with_new_child() {
    local pid
    pid=$(child_pid "$1")
    [ -n "$pid" ] && [ "$pid" != "$2" ] && vllm-warden status -c "/etc/vllm-warden/$1.toml" >/dev/null \
        && [ "$(child_pid "$1")" = "$pid" ]
}
prop() { systemctl show -p "$2" --value "vllm-warden@$1"; }

systemctl is-system-running --wait >/dev/null || true

# Install: the package enables nothing and creates the user.
check "the package installs" dpkg -i /opt/payload/vllm-warden.deb
check "the vllm user exists" id vllm
check "the template unit is known" systemctl cat vllm-warden@x.service
check "installing started no instance" test -z "$(systemctl list-units --no-legend 'vllm-warden@*')"
check "the man pages are installed" test -f /usr/share/man/man8/vllm-warden.8.gz -a -f /usr/share/man/man5/vllm-warden.toml.5.gz
check "the completions are installed" test -f /usr/share/bash-completion/completions/vllm-warden
check "the alert rules, the PrometheusRule and the dashboard are installed" test -f /usr/share/vllm-warden/vllm-warden.rules.yml -a -f /usr/share/vllm-warden/vllm-warden.prometheusrule.yaml -a -f /usr/share/vllm-warden/vllm-warden.dashboard.json
check "the example config is installed" test -f /etc/vllm-warden/kimi.toml.example
check "the simulator is installed beside, not in, the warden" test -x /usr/lib/vllm-warden/vllm-warden-sim
# Not in /tmp: in runs where this check failed, its output file was gone
# when read, as if a tmpfs had been mounted over /tmp meanwhile.
check "vllm-warden demo runs against it" bash -c "TMPDIR=/var/tmp vllm-warden demo >/var/tmp/demo.out 2>&1 \
    && grep -q 'exited with code 0' /var/tmp/demo.out || { tail -n 40 /var/tmp/demo.out; false; }"

fake() {  # name port extra-fake-args… ; then more TOML on stdin
    local name=$1 port=$2; shift 2
    local args=""
    for a in "$@"; do args+=", \"$a\""; done
    {
        echo "[child]"
        echo "command = [\"/usr/lib/vllm-warden/vllm-warden-sim\", \"--port\", \"$port\"$args]"
        cat
    } > "/etc/vllm-warden/$name.toml"
}

# Start blocks until the model is ready.
fake demo 8000 --shards 4 --shard-time 300ms <<'TOML'
env = { MARKER = "1" }
[restart]
initial-delay = "1s"
TOML
start=$SECONDS
check "systemctl start returns when the model is ready" systemctl start vllm-warden@demo
check "the unit is active" systemctl is-active --quiet vllm-warden@demo
check "vllm-warden status says ready" vllm-warden status -c /etc/vllm-warden/demo.toml
check "vllm-warden status NAME and list name it" bash -c "vllm-warden status demo >/dev/null && vllm-warden list | grep -q '^demo  *ready '"
check "systemctl status shows the warden's STATUS=" bash -c "systemctl status --no-pager vllm-warden@demo | grep -q 'Status: \"ready: pid '"
check "the journal has the warden's events" bash -c "journalctl -u vllm-warden@demo EVENT=ready --no-pager -o cat | grep -q 'ready: pid'"
check "the journal has the child's lines as vllm-demo" bash -c "journalctl -u vllm-warden@demo SYSLOG_IDENTIFIER=vllm-demo --no-pager -o cat | grep -q 'Application startup complete'"
check "the child's INFO lines are priority info" bash -c "journalctl -u vllm-warden@demo SYSLOG_IDENTIFIER=vllm-demo -p info..info --no-pager -o cat | grep -q 'Starting to load model'"
check "the log file is in LogsDirectory" test -s /var/log/vllm-warden/demo.log

# A child killed with SIGKILL is restarted by the warden, not by systemd.
main=$(prop demo MainPID)
old=$(child_pid demo)
kill -9 "$old"
check "the warden restarts a killed child" wait_for 60 ready_with_new_child demo "$old"
check "systemd did not restart the unit" test "$(prop demo NRestarts)" = 0 -a "$(prop demo MainPID)" = "$main"

# A load longer than TimeoutStartSec= lives on EXTEND_TIMEOUT_USEC.
mkdir -p /etc/systemd/system/vllm-warden@slow.service.d
printf '[Service]\nTimeoutStartSec=3s\n' > /etc/systemd/system/vllm-warden@slow.service.d/timeout.conf
systemctl daemon-reload
fake slow 8001 --shards 8 --shard-time 1s <<'TOML'
[ready]
stall = "3s"
TOML
start=$SECONDS
check "a load of 8 s survives TimeoutStartSec=3s" systemctl start vllm-warden@slow
systemctl is-active --quiet vllm-warden@slow || journalctl -u vllm-warden@slow --no-pager -o short-precise | tail -n 40
check "… and took longer than the timeout" test $((SECONDS - start)) -ge 4
systemctl stop vllm-warden@slow

# A broken config fails `systemctl reload` (ExecReload= waits for the
# warden's verdict); the model keeps serving; the journal holds why.
old=$(child_pid demo)
cp /etc/vllm-warden/demo.toml /tmp/demo.toml.good
sed -i 's/^\[child\]$/[child]\nstop-timeout = "soon"/' /etc/vllm-warden/demo.toml
reload_fails() { ! systemctl reload vllm-warden@demo 2>/dev/null; }
same_child_serving() { systemctl is-active --quiet vllm-warden@demo && test "$(child_pid demo)" = "$1"; }
journal_names_line() { journalctl -u vllm-warden@demo --no-pager | grep -q 'demo.toml:[0-9]*:[0-9]*: .*stop-timeout'; }
reload_refused_in_status() { grep -q '"outcome": "refused"' /run/vllm-warden/demo/status.json; }
check "systemctl reload fails on a broken config" reload_fails
check "… the unit is still active, the same child serving" same_child_serving "$old"
check "… the journal says which line" journal_names_line
check "… and the status document says refused" reload_refused_in_status
cp /tmp/demo.toml.good /etc/vllm-warden/demo.toml

# Reload applies a changed config.
sed -i 's/MARKER = "1"/MARKER = "2"/' /etc/vllm-warden/demo.toml
check "systemctl reload is accepted" systemctl reload vllm-warden@demo
check "the child is started again after the reload" wait_for 60 ready_with_new_child demo "$old"
check "the new child has the new environment" bash -c "tr '\0' '\n' < /proc/$(child_pid demo)/environ | grep -qx MARKER=2"

# The control socket under the unit: drain, undrain, restart.
status_is() { vllm-warden status -c "/etc/vllm-warden/$1.toml" >/dev/null; test $? = "$2"; }
unit_status_has() { systemctl status --no-pager "vllm-warden@$1" 2>/dev/null | grep -q "Status: \"$2"; }
check "the control socket is in RuntimeDirectory, mode 660" \
    bash -c 'test -S /run/vllm-warden/demo/control.sock && test "$(stat -c %a /run/vllm-warden/demo/control.sock)" = 660'
check "vllm-warden drain answers over it" vllm-warden drain -c /etc/vllm-warden/demo.toml
check "status is 3 while draining" status_is demo 3
check "the unit's status says drained once drained" wait_for 30 unit_status_has demo "drained: pid "
check "vllm-warden undrain" vllm-warden undrain -c /etc/vllm-warden/demo.toml
check "ready again at once" status_is demo 0
old=$(child_pid demo)
check "vllm-warden restart" vllm-warden restart -c /etc/vllm-warden/demo.toml
check "the child is started again after the restart" wait_for 60 ready_with_new_child demo "$old"
check "systemd did not restart the unit for it" test "$(prop demo NRestarts)" = 0

# Stop leaves no process of the unit.
check "systemctl stop" systemctl stop vllm-warden@demo
check "no process of the unit is left" bash -c "! pgrep -f 'vllm-warden [f]ake-vllm' >/dev/null"
check "the unit stopped cleanly" test "$(prop demo Result)" = success

# The Ray composition (examples/ray/): the model's unit, with the drop-in,
# starts after the head's unit is ready, is stopped first when the head's
# unit stops, and sees the head's /tmp. Both pieces are the simulated server
# here; tests/real-ray/run.sh runs the real Ray.
fake ray-head 8101 --shards 1 <<'TOML'
TOML
fake kimi 8102 --shards 1 <<'TOML'
TOML
mkdir -p /etc/systemd/system/vllm-warden@kimi.service.d
cp /opt/payload/ray.conf /etc/systemd/system/vllm-warden@kimi.service.d/ray.conf
systemctl daemon-reload
mono() { systemctl show -p "$2" --value "vllm-warden@$1"; }
check "starting the model starts the head" bash -c "systemctl start vllm-warden@kimi \
    && systemctl is-active --quiet vllm-warden@ray-head"
check "the model started after the head was ready" \
    test "$(mono ray-head ActiveEnterTimestampMonotonic)" -le "$(mono kimi ExecMainStartTimestampMonotonic)"
check "the model's unit sees the head's /tmp" bash -c "h=\$(stat -L -c %d:%i /proc/$(prop ray-head MainPID)/root/tmp) \
    && k=\$(stat -L -c %d:%i /proc/$(prop kimi MainPID)/root/tmp) && [ \"\$h\" = \"\$k\" ] \
    && [ \"\$h\" != \"\$(stat -L -c %d:%i /tmp)\" ]"
check "stopping the head stops the model" bash -c "systemctl stop vllm-warden@ray-head \
    && ! systemctl is-active --quiet vllm-warden@kimi"
check "the model stopped before the head began to" \
    test "$(mono kimi InactiveEnterTimestampMonotonic)" -le "$(mono ray-head ActiveExitTimestampMonotonic)"
rm -r /etc/systemd/system/vllm-warden@kimi.service.d
systemctl daemon-reload

# A permanent failure ends with 78, and systemd does not restart it.
fake perm 8002 --shards 1 --fail kv-cache <<'TOML'
[restart]
initial-delay = "0s"
TOML
check "a permanently failing start fails" bash -c "! systemctl start vllm-warden@perm"
check "… with exit status 78" test "$(prop perm ExecMainStatus)" = 78
# A restart would show as activating/auto-restart; a prevented one as failed.
check "… and is not restarted" test "$(prop perm ActiveState)/$(prop perm SubState)" = failed/failed
check "the journal names the cause" bash -c "journalctl -u vllm-warden@perm --no-pager -o cat | grep -q 'failed permanently (2 of 2 tries): NotImplementedError: Currently supported kv cache quantization'"
# Each failed run left its failure report in the state directory, and the
# journal's `failed` event names it.
check "the failed events carry REPORT= with a report folder" bash -c "journalctl -u vllm-warden@perm EVENT=failed --no-pager -o json | grep -o '\"REPORT\":\"[^\"]*\"' | grep -q '/var/lib/vllm-warden/perm/reports/'"
check "two failure reports, each with its summary" bash -c "test \$(ls /var/lib/vllm-warden/perm/reports/*/summary.json | wc -l) = 2"
check "vllm-warden reports lists them" bash -c "vllm-warden reports -c /etc/vllm-warden/perm.toml | grep -c ' permanent ' | grep -qx 2"

# Memory fit, as installed: the simulated vLLM fails with vLLM's own
# KV-cache error; the warden (user vllm, the shipped unit, no drop-in)
# starts it again with the estimate, pins the value in its state
# directory, and the next start uses it at once.
fake fit 8006 --shards 1 --max-model-len 100000 --kv-cache-tokens 70000 <<'TOML'
[restart]
initial-delay = "0s"
[golden]
enabled = false
[fit]
enabled = true
min-model-len = 1024
TOML
check "memory fit: systemctl start returns ready" systemctl start vllm-warden@fit
check "… after a fit move in the journal, with its MESSAGE_ID" bash -c "journalctl -u vllm-warden@fit MESSAGE_ID=7c2e9a4f1b6d4c3e8a5f0d2b9e7c1a64 --no-pager -o cat | grep -q 'restarting with --max-model-len 69632'"
check "… the value pinned by user vllm in the state directory" bash -c "test \"\$(stat -c %U /var/lib/vllm-warden/fit/fit-pins.json)\" = vllm && grep -q 69632 /var/lib/vllm-warden/fit/fit-pins.json"
check "… the unit's status shows the fitted value" bash -c "systemctl status --no-pager vllm-warden@fit | grep -q -- '--max-model-len 69632 (fitted)'"
check "memory fit: the next start is pinned, at the first try" bash -c "systemctl restart vllm-warden@fit \
    && vllm-warden status -c /etc/vllm-warden/fit.toml | grep -q 'memory fit: --max-model-len 69632 (pinned)' \
    && vllm-warden status -c /etc/vllm-warden/fit.toml --json | grep -q '\"restarts\": *0'"
systemctl stop vllm-warden@fit

# Rollback, as installed: a good setup, then a reload to one that fails
# for good; the last-known-good serves again, the unit stays active.
fake lkg 8007 --shards 1 <<'TOML'
[restart]
initial-delay = "0s"
permanent-attempts = 1
[golden]
enabled = false
[rollback]
enabled = true
TOML
check "rollback: the good setup starts" systemctl start vllm-warden@lkg
main=$(prop lkg MainPID)
sed -i 's|"--shards", "1"|"--shards", "1", "--fail", "kv-cache"|' /etc/vllm-warden/lkg.toml
check "rollback: systemctl reload to a failing setup" systemctl reload vllm-warden@lkg
check "… the last-known-good serves again" wait_for 60 unit_status_has lkg "serving last-known-good from "
check "… the unit stayed active, not restarted" test "$(prop lkg ActiveState)/$(prop lkg MainPID)/$(prop lkg NRestarts)" = "active/$main/0"
check "… the journal says so, with its MESSAGE_ID" bash -c "journalctl -u vllm-warden@lkg MESSAGE_ID=e41f6b8d2c9a4e7f9b3d5a1c8e6f2d07 --no-pager -o cat | grep -q 'starting the last-known-good setup'"
check "… the status document has both setups" bash -c "vllm-warden status -c /etc/vllm-warden/lkg.toml --json | grep -q '\"setup\": *\"last-known-good\"'"
check "… the setups are the service user's, mode 600" bash -c "test \"\$(stat -c %U:%a /var/lib/vllm-warden/lkg/setups/*.json)\" = vllm:600"
check "vllm-warden setups diff names the change" bash -c "vllm-warden setups -c /etc/vllm-warden/lkg.toml diff | grep -q -- '--fail kv-cache'"
systemctl stop vllm-warden@lkg

# A child that floods its log: its lines go to journald through the
# warden's bounded queue; what journald cannot take in time is dropped from
# the forwarding only, and counted (vllm_warden_journal_dropped_lines_total);
# journald's own rate limit (10000 lines in 30 s by default; lifted here to
# measure the forwarding itself) would suppress more, and say how many.
mkdir -p /etc/systemd/system/vllm-warden@flood.service.d
printf '[Service]\nLogRateLimitIntervalSec=0\n' > /etc/systemd/system/vllm-warden@flood.service.d/rate.conf
systemctl daemon-reload
fake flood 8003 --shards 1 --flood-after-ready 20000000 <<'TOML'
[status]
metrics-file = "/run/vllm-warden/flood/vllm_warden.prom"
TOML
check "a child that floods its log starts" systemctl start vllm-warden@flood
flooded() { grep -o 'flood done [0-9]*' /var/log/vllm-warden/flood.log | grep -o '[0-9]*$'; }
forwarded() { journalctl -u vllm-warden@flood SYSLOG_IDENTIFIER=vllm-flood -o cat --no-pager | grep -c ' flood [0-9]\{10\} '; }
dropped() { awk '/^vllm_warden_journal_dropped_lines_total/ {print $2}' /run/vllm-warden/flood/vllm_warden.prom 2>/dev/null; }
suppressed() {
    journalctl _SYSTEMD_UNIT=systemd-journald.service -o cat --no-pager 2>/dev/null \
        | grep -o 'Suppressed [0-9]* messages from vllm-warden@flood.service' | awk '{s += $2} END {print s + 0}'
}
accounted() {
    local n d
    n=$(flooded) || return 1
    d=$(dropped)
    [ $(($(forwarded) + ${d:-0} + $(suppressed))) -ge "$n" ]
}
check "the flood was written" wait_for 120 eval "flooded >/dev/null"
check "every flooded line is in the journal, dropped and counted by the warden, or suppressed by journald" \
    wait_for 120 accounted
total=$(flooded); fwd=$(forwarded); drp=$(dropped); sup=$(suppressed)
span=$(journalctl -u vllm-warden@flood SYSLOG_IDENTIFIER=vllm-flood -o short-unix --no-pager | grep ' flood [0-9]\{10\} ' \
    | awk 'NR == 1 {first = $1} {last = $1} END {printf "%.3f", last - first}')
echo "# journald forwarding: $total lines written; $fwd in the journal over ${span}s ($(awk -v n="$fwd" -v s="$span" 'BEGIN {if (s > 0) printf "%d", n / s; else print "-"}') lines/s); $drp dropped by the warden's queue; $sup suppressed by journald's rate limit"
check "the warden stayed responsive" vllm-warden status -c /etc/vllm-warden/flood.toml
systemctl stop vllm-warden@flood

# A host OOM kill under the shipped unit (OOMPolicy=continue): a drop-in
# gives this instance a small MemoryMax=, its child allocates past it once.
# The unit stays active, the warden names the kill and restarts the child.
# Only where the container's systemd can enforce MemoryMax=: a memory
# controller of its own (cgroup v2 with memory, or a writable v1 memory
# hierarchy). On a host whose cgroups give the container none (v1, its
# memory hierarchy read-only), the limit is not set and the child would
# allocate until the host's OOM killer picked a victim, whichever: skipped,
# and said.
memory_limits() {
    grep -qw memory /sys/fs/cgroup/cgroup.controllers 2>/dev/null ||
        { [ -d /sys/fs/cgroup/memory ] && ! findmnt -n -o OPTIONS /sys/fs/cgroup/memory | tr ',' '\n' | grep -qx ro; }
}
if ! memory_limits; then
    ok "the warden names the OOM kill of its child # SKIP this container has no memory controller of its own (cgroup v1, read-only): MemoryMax= cannot be enforced"
else
mkdir -p /etc/systemd/system/vllm-warden@oom.service.d
printf '[Service]\nMemoryMax=256M\nMemorySwapMax=0\n' >/etc/systemd/system/vllm-warden@oom.service.d/memory.conf
systemctl daemon-reload
fake oom 8009 --shards 1 --fail oom --fail-times 1 --count-file /var/lib/vllm-warden/oom/count <<'TOML'
[restart]
initial-delay = "0s"
TOML
check "an instance under MemoryMax=256M starts" systemctl start vllm-warden@oom
main=$(prop oom MainPID)
oom_named() { journalctl -u vllm-warden@oom EVENT=failed --no-pager -o cat | grep -q "killed by the kernel's OOM killer (host memory)"; }
check "the warden names the OOM kill of its child" wait_for 60 oom_named
if ! oom_named; then
    echo "#   the unit's memory limit: $(systemctl show -p MemoryMax --value vllm-warden@oom), cgroup: $(cat /proc/"$main"/cgroup | tr '\n' ' ')"
    journalctl -u vllm-warden@oom --no-pager -o cat | grep -v '^$' | tail -n 15 | sed 's/^/#   journal: /'
fi
check "… and restarts it, the unit active, same main pid" wait_for 60 bash -c \
    "grep -q '\"state\": \"ready\"' /run/vllm-warden/oom/status.json && test \"\$(systemctl is-active vllm-warden@oom)/\$(systemctl show -p MainPID --value vllm-warden@oom)/\$(systemctl show -p NRestarts --value vllm-warden@oom)\" = active/$main/0"
systemctl stop vllm-warden@oom
fi

# Installing a later package upgrades a running warden in place: the unit
# stays active with the same main pid, the server keeps its pid, and the
# new binary says so.
fake up 8004 --shards 1 <<'TOML'
TOML
check "an instance to upgrade starts" systemctl start vllm-warden@up
main=$(prop up MainPID)
old=$(child_pid up)
check "a later package installs over the running instance" dpkg -i /opt/payload/vllm-warden-next.deb
# The new warden says it, then proves the answers of what it took over.
upgraded() { journalctl -u vllm-warden@up EVENT=upgrade --no-pager -o cat | grep -q '^upgraded from '; }
check "systemctl status shows the new binary's status line" wait_for 60 upgraded
check "the unit stayed active, same main pid, not restarted" \
    test "$(systemctl is-active vllm-warden@up)/$(prop up MainPID)/$(prop up NRestarts)" = "active/$main/0"
check "the server kept its pid" test "$(child_pid up)" = "$old"
check "the warden runs the new file" bash -c "! readlink /proc/$main/exe | grep -q deleted"
check "the journal shows the re-exec" bash -c "journalctl -u vllm-warden@up EVENT=upgrade --no-pager -o cat | grep -q 'handing pid $old over'"
systemctl stop vllm-warden@up
