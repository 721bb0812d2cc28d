#!/usr/bin/env bash
# deploy/*.yaml, the kubectl-only install, rendered from the chart (one source of truth):
#   deploy/rbac.yaml      the kvscale-system namespace, the operator's ServiceAccount and RBAC
#   deploy/operator.yaml  the operator Deployment and its PodDisruptionBudget
# charts/kvscale/files/crds/ refreshed from crds/ (the CRD's source), and the chart's
# templates/namespace-router.yaml and _security.tpl written by `kvscale operator render-router`
# from the builders the operator makes each InferenceService's router and pods with. `make deploy-render` runs it;
# tests/charts/test_chart_render.py fails when the committed files are stale.
# With --check, writes nothing and exits 1 when a file would change.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
helm="${HELM:-$(bash "$repo_root/tools/k8s-bins.sh" | tail -1)/helm}"
python="${PYTHON:-$repo_root/.venv/bin/python}"
chart="$repo_root/charts/kvscale"
check=false
[[ "${1:-}" == --check ]] && check=true

render() {  # template files..., then the output on stdout
    local args=()
    for template in "$@"; do args+=(--show-only "templates/$template"); done
    echo "# Rendered from charts/kvscale by \`make deploy-render\` (helm template, release kvscale in"
    echo "# namespace kvscale-system): edit the chart, not this file."
    "$helm" template kvscale "$chart" --namespace kvscale-system \
        --set createNamespace=true --set crds.install=false "${args[@]}"
}

status=0
emit() {  # target, then the content on stdin
    local target="$1" tmp
    tmp="$(mktemp)"
    cat > "$tmp"
    if cmp -s "$tmp" "$target"; then rm -f "$tmp"; return; fi
    if $check; then
        echo "stale: ${target#"$repo_root/"} (run make deploy-render)" >&2
        status=1; rm -f "$tmp"
    else
        mv "$tmp" "$target"; echo "wrote ${target#"$repo_root/"}" >&2
    fi
}

for crd in "$repo_root"/crds/*.yaml; do
    emit "$chart/files/crds/$(basename "$crd")" < "$crd"
done
# The chart's namespace-wide router (a variable first, so that a failing render stops the script).
router_template="$("$python" -m kvscale operator render-router --helm)"
emit "$chart/templates/namespace-router.yaml" <<< "$router_template"
# The security contexts of the chart's own pods: those of every pod the operator makes.
security_template="$("$python" -m kvscale operator render-router --helm-security)"
emit "$chart/templates/_security.tpl" <<< "$security_template"
# Not `render | emit`: emit must run in this shell to record a stale file.
emit "$repo_root/deploy/rbac.yaml" < <(render namespace.yaml serviceaccount.yaml rbac.yaml)
emit "$repo_root/deploy/operator.yaml" < <(render operator.yaml)
exit $status
