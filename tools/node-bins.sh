#!/usr/bin/env bash
# Builds what the real-node lane (tests/node) runs beside the control plane of tools/k8s-bins.sh:
#   kubelet, kube-proxy  from the same tools/k8s module as kube-apiserver (same k8s.io/kubernetes
#                        version, same version ldflags), so node and apiserver are one release
#   coredns              the cluster DNS, `go install github.com/coredns/coredns@<pin>` (the
#                        version kubeadm pairs with this Kubernetes minor)
# into a cache folder outside the repo keyed by the pins; a second run builds nothing. The folder
# is printed on the last stdout line; progress goes to stderr. containerd, runc and the CNI
# plugins come from Debian (tools/system-deps.sh), not from here.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
k8s_module="$repo_root/tools/k8s"
coredns_version="v1.12.1"  # kubeadm's CoreDNS for Kubernetes 1.34
everything=(kubelet kube-proxy coredns)

log() { echo "node-bins: $*" >&2; }
die() { log "error: $*"; exit 1; }

command -v go >/dev/null || die "Go is not on PATH; install Go >= 1.26"

k8s_version="$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" {print $3; exit}
                    $1 == "k8s.io/kubernetes" {print $2; exit}' "$k8s_module/go.mod")"
[[ -n "$k8s_version" ]] || die "cannot read the k8s.io/kubernetes pin from tools/k8s/go.mod"
inputs_hash="$(cat "$k8s_module/go.mod" "$k8s_module/go.sum" "${BASH_SOURCE[0]}" \
    <(go env GOVERSION) | sha256sum | cut -c1-10)"
key="k8s-${k8s_version}_coredns-${coredns_version}_${inputs_hash}"
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/kvscale/node-bins"
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

export CGO_ENABLED=0
# The same -X flags as tools/k8s-bins.sh: the kubelet reports this version in the Node's
# nodeInfo, and a v0.0.0 kubelet would look older than the apiserver.
k8s_minor="${k8s_version#v1.}"; k8s_minor="${k8s_minor%%.*}"
k8s_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    k8s_ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
    k8s_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

staging="$cache_root/.staging-$key"
rm -rf "$staging"
mkdir -p "$staging"
trap 'rm -rf "$staging"' EXIT

started=$SECONDS
if [[ ! -x "$bin_dir/kubelet" || ! -x "$bin_dir/kube-proxy" ]]; then
    t0=$SECONDS
    log "building kubelet, kube-proxy $k8s_version ..."
    (cd "$k8s_module" && go build -ldflags="$k8s_ldflags" -o "$staging/" \
        k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy) \
        || die "building kubelet and kube-proxy failed"
    mv "$staging"/* "$bin_dir/"
    log "built kubelet, kube-proxy in $((SECONDS - t0))s"
fi
if [[ ! -x "$bin_dir/coredns" ]]; then
    t0=$SECONDS
    log "building coredns $coredns_version ..."
    GOBIN="$staging" go install -ldflags="-s -w" "github.com/coredns/coredns@$coredns_version" \
        || die "building coredns failed"
    mv "$staging"/* "$bin_dir/"
    log "built coredns in $((SECONDS - t0))s"
fi

for name in "${everything[@]}"; do
    [[ -x "$bin_dir/$name" ]] || die "still missing after the build: $name"
done
touch "$bin_dir/.complete"
log "all binaries in $bin_dir (built in $((SECONDS - started))s)"
echo "$bin_dir"
