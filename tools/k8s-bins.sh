#!/usr/bin/env bash
# Builds the control plane the operator tests run against -- kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl (k8s.io/kubernetes, via the
# tools/k8s module), etcd (tools/etcd), kwok -- and helm, from Go modules,
# into a cache folder outside the repo keyed by the pinned versions. A second
# run finds the folder complete and builds nothing. The folder is printed on
# the last stdout line; progress goes to stderr.
#
# KUBEBUILDER_ASSETS (envtest's convention): when it names a folder holding
# the control-plane binaries, that folder is used as is and nothing is built.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
k8s_module="$repo_root/tools/k8s"
etcd_module="$repo_root/tools/etcd"

# Tools outside the two modules, built with `go install pkg@version`.
kwok_version="v0.7.0"
helm_version="v3.19.5"

# What the tests cannot run without; helm is for the chart tests only.
control_plane=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok kubectl)
everything=("${control_plane[@]}" helm)

log() { echo "k8s-bins: $*" >&2; }
die() { log "error: $*"; exit 1; }

missing_in() {
    local dir="$1"; shift
    local name missing=()
    for name in "$@"; do
        [[ -x "$dir/$name" ]] || missing+=("$name")
    done
    echo "${missing[*]:-}"
}

if [[ -n "${KUBEBUILDER_ASSETS:-}" ]]; then
    [[ -d "$KUBEBUILDER_ASSETS" ]] || die "KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS is not a folder"
    lacking="$(missing_in "$KUBEBUILDER_ASSETS" "${control_plane[@]}")"
    [[ -z "$lacking" ]] || die "KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS lacks: $lacking (unset it to build them all)"
    [[ -x "$KUBEBUILDER_ASSETS/helm" ]] || log "note: no helm in KUBEBUILDER_ASSETS; the chart tests need it"
    log "using KUBEBUILDER_ASSETS, building nothing"
    echo "$KUBEBUILDER_ASSETS"
    exit 0
fi

command -v go >/dev/null || die "Go is not on PATH; install Go >= 1.26 or set KUBEBUILDER_ASSETS"

module_version() {  # the version a go.mod requires a module at
    awk -v mod="$2" '$1 == "require" && $2 == mod {print $3; exit} $1 == mod {print $2; exit}' "$1"
}
k8s_version="$(module_version "$k8s_module/go.mod" k8s.io/kubernetes)"
etcd_version="$(module_version "$etcd_module/go.mod" go.etcd.io/etcd/server/v3)"
[[ -n "$k8s_version" && -n "$etcd_version" ]] || die "cannot read pinned versions from tools/*/go.mod"

# Any change to the modules, this script or the Go release gets a new folder.
inputs_hash="$(cat "$k8s_module/go.mod" "$k8s_module/go.sum" "$etcd_module/go.mod" \
    "$etcd_module/go.sum" "$etcd_module/main.go" "${BASH_SOURCE[0]}" <(go env GOVERSION) \
    | sha256sum | cut -c1-10)"
key="k8s-${k8s_version}_etcd-${etcd_version}_kwok-${kwok_version}_helm-${helm_version}_${inputs_hash}"
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/kvscale/k8s-bins"
bin_dir="$cache_root/$key"

if [[ -f "$bin_dir/.complete" ]]; then
    echo "$bin_dir"
    exit 0
fi

mkdir -p "$bin_dir"
# Two concurrent runs (make and a pytest fixture, say) must not both build.
exec 9>"$cache_root/.lock-$key"
flock 9
if [[ -f "$bin_dir/.complete" ]]; then
    echo "$bin_dir"
    exit 0
fi

export CGO_ENABLED=0
# Stripped binaries link faster and are half the size; -X only touches the
# link step, so Go's compile cache is shared by every binary below.
k8s_minor="${k8s_version#v1.}"; k8s_minor="${k8s_minor%%.*}"
k8s_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    k8s_ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
    k8s_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

started=$SECONDS
build_step() {  # name, then the command that builds it into $bin_dir
    local name="$1"; shift
    if [[ -x "$bin_dir/$name" ]]; then return; fi
    local t0=$SECONDS
    log "building $name ..."
    "$@" || die "building $name failed"
    log "built $name in $((SECONDS - t0))s"
}

# Binaries are linked into a staging folder and renamed into place, so an
# interrupted build never leaves a half-written file that looks finished.
staging="$cache_root/.staging-$key"
rm -rf "$staging"
mkdir -p "$staging"
trap 'rm -rf "$staging"' EXIT
publish() { mv "$staging"/* "$bin_dir/"; }

build_k8s() {
    (cd "$k8s_module" && go build -ldflags="$k8s_ldflags" -o "$staging/" \
        k8s.io/kubernetes/cmd/kube-apiserver \
        k8s.io/kubernetes/cmd/kube-controller-manager \
        k8s.io/kubernetes/cmd/kube-scheduler) && publish
}
build_kubectl() {
    (cd "$k8s_module" && go build -ldflags="$k8s_ldflags" -o "$staging/kubectl" k8s.io/kubernetes/cmd/kubectl) && publish
}
build_etcd() {
    (cd "$etcd_module" && go build -ldflags="-s -w" -o "$staging/etcd" .) && publish
}
build_installable() {  # name, pkg@version, extra ldflags
    GOBIN="$staging" go install -ldflags="-s -w $3" "$2" && publish
}

k8s_missing="$(missing_in "$bin_dir" kube-apiserver kube-controller-manager kube-scheduler)"
if [[ -n "$k8s_missing" ]]; then
    # One `go build` for the three: they share most packages, and a partly
    # built set is simply rebuilt (the compile cache makes that cheap).
    t0=$SECONDS
    log "building kube-apiserver, kube-controller-manager, kube-scheduler $k8s_version ..."
    build_k8s || die "building the Kubernetes binaries failed"
    log "built the Kubernetes binaries in $((SECONDS - t0))s"
fi
build_step etcd build_etcd
build_step kwok build_installable kwok "sigs.k8s.io/kwok/cmd/kwok@$kwok_version" ""
build_step kubectl build_kubectl
# As helm's release Makefile: without these `helm version` says v3.19 and
# charts render against a default Kubernetes 1.20 (its client-go is v0.34).
helm_ldflags="-X helm.sh/helm/v3/internal/version.version=$helm_version"
helm_ldflags+=" -X helm.sh/helm/v3/internal/version.metadata="
helm_ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    helm_ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=34"
done
build_step helm build_installable helm "helm.sh/helm/v3/cmd/helm@$helm_version" "$helm_ldflags"

lacking="$(missing_in "$bin_dir" "${everything[@]}")"
[[ -z "$lacking" ]] || die "still missing after the build: $lacking"
touch "$bin_dir/.complete"
log "all binaries in $bin_dir (built in $((SECONDS - started))s)"
echo "$bin_dir"
