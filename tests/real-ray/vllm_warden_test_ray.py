"""Lets vLLM's CPU platform run under `--distributed-executor-backend ray`.

For the end-to-end tests only: setup.sh copies this module and
vllm_warden_test_ray.pth into the test venv's site-packages. The .pth file
imports this module at interpreter start only when
VLLM_WARDEN_TEST_RAY_DEVICE_KEY is set; vLLM itself is not changed.

vLLM 0.32.0's CpuPlatform has an empty `ray_device_key`, so the Ray executor
refuses it ("current platform cpu does not support ray."). Here, when
`vllm.platforms.cpu` is first imported, `CpuPlatform.ray_device_key` is set
to the variable's value: a resource name that Ray treats as an accelerator
(`neuron_cores`; Ray refuses `CPU`, and vLLM fails on other custom names).
Every Ray node is then started with `--resources='{"neuron_cores": 1}'`,
one per tensor-parallel rank it is to hold.

The variable must be set for the Ray nodes (`ray start`) as well as for
`vllm serve`: vLLM's RayWorkerProc actors are worker processes of each
node's raylet and inherit its environment, and they ask the platform for
the key before vLLM hands them its own variables. Without it on a node,
vLLM fails at startup with "RuntimeError: current platform cpu does not
support ray." raised in RayWorkerProc.get_node_and_physical_gpu_ids.

Nothing is imported early: a finder on sys.meta_path waits for the module
and wraps its loader, so processes that never import vLLM (pip, Ray's own
daemons) only pay for this file.
"""

import importlib.abc
import os
import sys

ENV = "VLLM_WARDEN_TEST_RAY_DEVICE_KEY"
TARGET = "vllm.platforms.cpu"


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, key):
        self._inner = inner
        self._key = key

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        module.CpuPlatform.ray_device_key = self._key

    def __getattr__(self, name):
        # get_source, get_filename, … for tracebacks and inspect.
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, key):
        self._key = key

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, self._key)
                return spec
        return None


def install():
    key = os.environ.get(ENV, "")
    if not key or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    module = sys.modules.get(TARGET)
    if module is not None:
        module.CpuPlatform.ray_device_key = key
        return
    sys.meta_path.insert(0, _Finder(key))


install()
