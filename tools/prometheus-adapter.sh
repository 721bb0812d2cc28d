#!/usr/bin/env bash
# Builds prometheus-adapter (sigs.k8s.io/prometheus-adapter, the custom-metrics API server the
# real HPA reads through in tests/operator/test_hpa.py and bench/autoscale_replay.py) from Go
# modules, as tools/k8s-bins.sh builds the control plane: a build-only module
# (tools/prometheus-adapter/, its go.mod and go.sum pin v0.12.0 and every dependency) with a
# `tool` directive, CGO off, stripped, into a cache folder outside the repo keyed by the pinned
# version, the module's files, this script and the Go release. A second run finds it and builds nothing. The binary's
# path is printed on the last stdout line; progress goes to stderr.
#
# KVSCALE_PROMETHEUS_ADAPTER: a prometheus-adapter binary of your own; used as is, nothing built.
# Apart from tools/k8s-bins.sh on purpose: that script's cache key hashes itself, so adding the
# adapter there would relink the whole control plane.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
module="$repo_root/tools/prometheus-adapter"
package="sigs.k8s.io/prometheus-adapter/cmd/adapter"

log() { echo "prometheus-adapter: $*" >&2; }
die() { log "error: $*"; exit 1; }

if [[ -n "${KVSCALE_PROMETHEUS_ADAPTER:-}" ]]; then
    [[ -x "$KVSCALE_PROMETHEUS_ADAPTER" ]] \
        || die "KVSCALE_PROMETHEUS_ADAPTER=$KVSCALE_PROMETHEUS_ADAPTER is not an executable"
    echo "$KVSCALE_PROMETHEUS_ADAPTER"
    exit 0
fi

command -v go >/dev/null || die "Go is not on PATH; install Go or set KVSCALE_PROMETHEUS_ADAPTER"

# v0.12.0, the newest release: the module proxy serves it and its checksum verifies (v0.11.1 is
# refused, v0.10.0's checksum lookup answers 404). `go install pkg@version` would be simpler
# but reads the module's version list (for deprecation notices), which the proxy here refuses.
version="$(awk '$1 == "sigs.k8s.io/prometheus-adapter" {print $2; exit}' "$module/go.mod")"
[[ -n "$version" ]] || die "cannot read the pinned sigs.k8s.io/prometheus-adapter from $module/go.mod"
inputs_hash="$(cat "$module/go.mod" "$module/go.sum" "${BASH_SOURCE[0]}" <(go env GOVERSION) \
    | sha256sum | cut -c1-10)"
key="prometheus-adapter-${version}_${inputs_hash}"
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/kvscale/k8s-bins"
bin_dir="$cache_root/$key"
binary="$bin_dir/prometheus-adapter"

if [[ -f "$bin_dir/.complete" ]]; then
    echo "$binary"
    exit 0
fi

mkdir -p "$bin_dir"
# make's -j3 and a pytest fixture may both ask: only one builds.
exec 9>"$cache_root/.lock-$key"
flock 9
if [[ -f "$bin_dir/.complete" ]]; then
    echo "$binary"
    exit 0
fi

# Linked into a staging folder and renamed into place: an interrupted build never leaves a
# half-written binary that looks finished.
staging="$cache_root/.staging-$key"
rm -rf "$staging"
mkdir -p "$staging"
trap 'rm -rf "$staging"' EXIT
t0=$SECONDS
log "building $package $version ..."
# The version as `adapter --version` and /version report it (else v0.0.0-master).
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitTreeState=clean"
done
(cd "$module" && CGO_ENABLED=0 go build -ldflags="$ldflags" -o "$staging/adapter" "$package") \
    || die "building $package $version failed"
mv "$staging/adapter" "$binary"
touch "$bin_dir/.complete"
log "built prometheus-adapter $version in $((SECONDS - t0))s"
echo "$binary"
