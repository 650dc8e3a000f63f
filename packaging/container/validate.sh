#!/usr/bin/env bash
# Validates the Kubernetes manifests of this folder against the API's
# schemas with kubernetes-validate (PyPI, pinned), installed once into a
# venv outside the repository. Prints the validator's output; exits
# non-zero when a manifest is invalid.
set -euo pipefail
cd "$(dirname "$0")"
version=1.37.0
# The Kubernetes version whose schemas the manifests must satisfy.
kubernetes=${KUBERNETES_VERSION:-1.33.0}
venv=${VLLM_WARDEN_TOOLS:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/vllm-warden}/kubernetes-validate-$version
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install -q "kubernetes-validate==$version" >&2
fi
"$venv/bin/kubernetes-validate" --version
"$venv/bin/kubernetes-validate" --strict --kubernetes-version "$kubernetes" deployment.yaml
