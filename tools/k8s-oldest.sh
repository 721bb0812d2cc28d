#!/usr/bin/env bash
# Builds kube-apiserver at the oldest Kubernetes minor the chart supports (Chart.yaml's
# kubeVersion floor), from the tools/k8s-oldest module, into the same cache as tools/k8s-bins.sh
# (a folder of its own, keyed by its inputs). Only the apiserver: proving the chart's objects
# against that version needs nothing else (tests/charts/test_kube_versions.py runs it with the
# etcd of tools/k8s-bins.sh and `kubectl apply --dry-run=server`). A second run builds nothing.
# The folder is printed on the last stdout line; progress goes to stderr.
#
# KVSCALE_OLDEST_K8S_ASSETS: a folder already holding that kube-apiserver; used as is.
# Apart from tools/k8s-bins.sh on purpose: its cache key hashes that script, so a change here
# never rebuilds the whole control plane.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
module="$repo_root/tools/k8s-oldest"

log() { echo "k8s-oldest: $*" >&2; }
die() { log "error: $*"; exit 1; }

if [[ -n "${KVSCALE_OLDEST_K8S_ASSETS:-}" ]]; then
    [[ -x "$KVSCALE_OLDEST_K8S_ASSETS/kube-apiserver" ]] \
        || die "KVSCALE_OLDEST_K8S_ASSETS=$KVSCALE_OLDEST_K8S_ASSETS has no kube-apiserver"
    echo "$KVSCALE_OLDEST_K8S_ASSETS"
    exit 0
fi

command -v go >/dev/null || die "Go is not on PATH; install Go or set KVSCALE_OLDEST_K8S_ASSETS"

version="$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" {print $3; exit}' "$module/go.mod")"
[[ -n "$version" ]] || die "cannot read the pinned k8s.io/kubernetes from $module/go.mod"
inputs_hash="$(cat "$module/go.mod" "$module/go.sum" "$module/tools.go" "${BASH_SOURCE[0]}" \
    <(go env GOVERSION) | sha256sum | cut -c1-10)"
key="k8s-apiserver-${version}_${inputs_hash}"
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/kvscale/k8s-bins"
bin_dir="$cache_root/$key"

if [[ -f "$bin_dir/.complete" ]]; then
    echo "$bin_dir"
    exit 0
fi

mkdir -p "$bin_dir"
exec 9>"$cache_root/.lock-$key"
flock 9
if [[ -f "$bin_dir/.complete" ]]; then
    echo "$bin_dir"
    exit 0
fi

# The version as `/version` reports it, set as tools/k8s-bins.sh does (else v0.0.0).
minor="${version#v1.}"; minor="${minor%%.*}"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

staging="$cache_root/.staging-$key"
rm -rf "$staging"
mkdir -p "$staging"
trap 'rm -rf "$staging"' EXIT
t0=$SECONDS
log "building kube-apiserver $version ..."
(cd "$module" && CGO_ENABLED=0 go build -ldflags="$ldflags" -o "$staging/" \
    k8s.io/kubernetes/cmd/kube-apiserver) || die "building kube-apiserver $version failed"
mv "$staging/kube-apiserver" "$bin_dir/"
touch "$bin_dir/.complete"
log "built kube-apiserver $version in $((SECONDS - t0))s"
echo "$bin_dir"
