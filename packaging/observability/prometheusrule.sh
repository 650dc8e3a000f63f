#!/usr/bin/env bash
# Prints the PrometheusRule manifest (the Prometheus Operator's resource)
# holding the rules of vllm-warden.rules.yml, word for word: the file's
# `groups:` under `spec:`. packaging/container/vllm-warden.prometheusrule.yaml
# is its output, and tests/observability.rs holds the two equal:
#   packaging/observability/prometheusrule.sh >packaging/container/vllm-warden.prometheusrule.yaml
set -euo pipefail
cd "$(dirname "$0")"
cat <<'HEAD'
# The alert rules of packaging/observability/vllm-warden.rules.yml as a
# PrometheusRule, for a Prometheus run by the Prometheus Operator. Generated
# by packaging/observability/prometheusrule.sh: edit the rules there, then
# run it. The operator picks it up when its ruleSelector matches these
# labels (often `release: <the Helm release>`: add that label).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: vllm-warden
  labels:
    app.kubernetes.io/name: vllm-warden
    app.kubernetes.io/component: alert-rules
spec:
HEAD
# Everything from `groups:` on, indented under `spec:`.
sed -n '/^groups:/,$p' vllm-warden.rules.yml | sed 's/^\(.\)/  \1/'
