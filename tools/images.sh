#!/usr/bin/env bash
# Builds kvscale's two images with podman (no Docker daemon, no registry needed):
#   engine         Dockerfile               `kvscale serve`, torch and the bundled model
#   control-plane  Dockerfile.control-plane `kvscale operator` and `kvscale router`, no torch
#                  (it copies the bundled tokenizer out of the engine image: built after it)
#
#   tools/images.sh build [engine|control-plane|all]   build (making the base image first if needed)
#   tools/images.sh base                               make sure the base image exists
#   tools/images.sh name engine|control-plane          the image's full name
#   tools/images.sh archive PATH [engine|control-plane|all]
#                                  save built images in one docker-archive (PATH - : stdout) for
#                                  `kind load image-archive PATH` or `ctr -n k8s.io images import PATH`
#   tools/images.sh push REGISTRY [engine|control-plane|all]
#                                  tag built images as REGISTRY/kvscale[-control-plane]:VERSION and
#                                  push them (KVSCALE_PUSH_TLS_VERIFY=false for a plain-HTTP one)
#   tools/images.sh podman ARGS...                     podman with kvscale's configuration
#
# podman's configuration and storage are kvscale's own (tools/images/containers.conf and
# storage.conf, rendered under $KVSCALE_PODMAN_DIR, default ~/.cache/kvscale/podman), never the
# user's. Build times go to stderr as `images: built NAME in Ns`.
#
# KVSCALE_IMAGE_REGISTRY (default ghcr.io/kvscale) names the images; KVSCALE_BUILD_CONTEXT
# builds from a copy of the checkout instead of the checkout.
# BASE_IMAGE is the Dockerfiles' base. By default it is kvscale's own, made here from Debian
# packages with debootstrap (Debian's python3 3.11, pip, venv) and named under localhost/kvscale/,
# so no registry is needed and no official name is shadowed. Another name (e.g.
# docker.io/library/python:3.11-slim) is pulled when it is not in the local storage.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
state="${KVSCALE_PODMAN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvscale/podman}"
version="$(awk -F'"' '/^version = /{print $2; exit}' "$repo_root/pyproject.toml")"
registry="${KVSCALE_IMAGE_REGISTRY:-ghcr.io/kvscale}"
own_base="localhost/kvscale/python-base:3.11-bookworm"
base_image="${BASE_IMAGE:-$own_base}"
# What an older tools/images.sh named its debootstrap base: renamed in place (same image, so no
# layer is rebuilt) unless it really is the official image.
legacy_base="docker.io/library/python:3.11-slim"
debian_suite="${DEBIAN_SUITE:-bookworm}"  # python3 3.11, as the default base
ca_bundle="${KVSCALE_BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

log() { echo "images: $*" >&2; }
die() { log "error: $*"; exit 1; }

image_name() {
    case "$1" in
        engine) echo "$registry/kvscale:$version" ;;
        control-plane) echo "$registry/kvscale-control-plane:$version" ;;
        *) die "unknown image '$1' (engine or control-plane)" ;;
    esac
}

# The build context: the checkout, or a copy of it (the layer-cache test changes a file there).
context="${KVSCALE_BUILD_CONTEXT:-$repo_root}"

dockerfile() {
    case "$1" in
        engine) echo "$context/Dockerfile" ;;
        control-plane) echo "$context/Dockerfile.control-plane" ;;
    esac
}

setup_podman() {
    command -v podman >/dev/null || die "podman is not installed (make system-deps)"
    mkdir -p "$state/tmp" "$state/storage" "$state/run"
    # Limits as high as the host lets the container's init set them, never higher: the hard
    # limits, and for nproc no more than pid_max (runc was refused anything above it here).
    local nofile nproc pid_max
    nofile="$(ulimit -Hn)"; nproc="$(ulimit -Hu)"
    pid_max="$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 32768)"
    [[ "$nofile" == unlimited ]] && nofile=1048576
    [[ "$nproc" == unlimited || "$nproc" -gt "$pid_max" ]] && nproc="$pid_max"
    sed -e "s/@NOFILE@/$nofile/g" -e "s/@NPROC@/$nproc/g" \
        "$repo_root/tools/images/containers.conf" > "$state/containers.conf"
    sed -e "s|@STATE@|$state|g" "$repo_root/tools/images/storage.conf" > "$state/storage.conf"
    export CONTAINERS_CONF="$state/containers.conf"
    export CONTAINERS_STORAGE_CONF="$state/storage.conf"
    private_tmpdir
}

# Layers are big, so podman's temporary files go under the state folder, not /tmp; and into a
# folder of this invocation's own, removed when it exits: `podman save` to a pipe first writes
# the whole archive (~6 GB for the engine) to a temporary file and leaves it there when the
# reader fails. A folder whose invocation was killed by a signal (no EXIT trap runs) is removed
# by the next invocation.
private_tmpdir() {
    local left pid
    for left in "$state"/tmp/pid-*; do
        [[ -d "$left" ]] || continue
        pid="${left##*/pid-}"
        kill -0 "$pid" 2>/dev/null || rm -rf "$left"
    done
    export TMPDIR="$state/tmp/pid-$$"
    mkdir -p "$TMPDIR"
    trap 'rm -rf "$TMPDIR"' EXIT
}

debian_mirror() {
    local mirror=""
    if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
        mirror="$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)"
    fi
    if [[ -z "$mirror" && -f /etc/apt/sources.list ]]; then
        mirror="$(awk '/^deb / && $3 !~ /security/ {print $2; exit}' /etc/apt/sources.list)"
    fi
    echo "${mirror:-http://deb.debian.org/debian}"
}

make_base() {
    if podman image exists "$base_image"; then
        return
    fi
    if [[ "$base_image" != "$own_base" ]]; then
        log "pulling $base_image ..."
        timeout 300 podman pull -q "$base_image" >/dev/null || die "cannot pull $base_image"
        return
    fi
    # The official image sets PYTHON_VERSION; the debootstrap one an older version made does not.
    if podman image exists "$legacy_base" \
        && ! podman image inspect --format '{{.Config.Env}}' "$legacy_base" | grep -q PYTHON_VERSION=; then
        podman tag "$legacy_base" "$base_image"
        podman untag "$legacy_base" "$legacy_base"
        log "renamed the local base $legacy_base to $base_image"
        return
    fi
    command -v debootstrap >/dev/null || die "debootstrap is not installed (make system-deps)"
    local mirror rootfs t0=$SECONDS
    mirror="$(debian_mirror)"
    rootfs="$state/tmp/base-rootfs"
    log "no registry: building $base_image from Debian $debian_suite packages ($mirror) ..."
    rm -rf "$rootfs"
    debootstrap --variant=minbase \
        --include=python3,python3-pip,python3-venv,python-is-python3,ca-certificates \
        "$debian_suite" "$rootfs" "$mirror" >"$state/tmp/debootstrap.log" 2>&1 \
        || die "debootstrap failed (see $state/tmp/debootstrap.log)"
    # pip in the image installs into its own venv; the marker would only get in the way.
    rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
    # What a container never reads (as in Debian's slim images): ~50 MB.
    rm -rf "$rootfs"/usr/share/{doc,man,info,locale,lintian}/*
    tar -C "$rootfs" -c . | podman import --change 'CMD ["python3"]' - "$base_image" >/dev/null
    rm -rf "$rootfs"
    log "made $base_image in $((SECONDS - t0))s"
}

build() {
    local which="$1" name t0=$SECONDS
    name="$(image_name "$which")"
    local volume=()
    # pip inside the build trusts what the host trusts (a proxy's CA, say); mounted for the
    # build only, so nothing of the host lands in the image.
    [[ -f "$ca_bundle" ]] && volume=(-v "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro")
    log "building $name ..."
    podman build --pull=never --layers "${volume[@]}" \
        --build-arg "BASE_IMAGE=$base_image" --build-arg "ENGINE_IMAGE=$(image_name engine)" \
        -f "$(dockerfile "$which")" -t "$name" "$context" >&2
    log "built $name in $((SECONDS - t0))s"
}

built_names() {  # the names of the built images `which` (engine, control-plane or all) covers
    local which="${1:-all}" names=() one
    case "$which" in
        all) names=("$(image_name engine)" "$(image_name control-plane)") ;;
        engine|control-plane) names=("$(image_name "$which")") ;;
        *) die "which image? engine, control-plane or all" ;;
    esac
    for one in "${names[@]}"; do
        podman image exists "$one" || die "$one is not built (make image)"
    done
    echo "${names[@]}"
}

archive() {
    local path="$1" names t0=$SECONDS
    read -r -a names <<<"$(built_names "${2:-all}")"
    # docker-archive, the format `docker save` writes: kind, ctr and k3d import it; several
    # images in one file need --multi-image-archive.
    if [[ "$path" == - ]]; then
        podman save --format docker-archive --multi-image-archive "${names[@]}"
    else
        mkdir -p "$(dirname "$path")"
        podman save --format docker-archive --multi-image-archive -o "$path" "${names[@]}"
        log "saved ${names[*]} to $path in $((SECONDS - t0))s"
        echo "$path"
    fi
}

push() {
    local target_registry="${1%/}" names one target tls=()
    [[ -n "$target_registry" ]] || die "push where? tools/images.sh push REGISTRY (host[:port]/path)"
    read -r -a names <<<"$(built_names "${2:-all}")"
    [[ "${KVSCALE_PUSH_TLS_VERIFY:-true}" == false ]] && tls=(--tls-verify=false)
    for one in "${names[@]}"; do
        # Same repository name and tag, another registry: the chart's repository values change,
        # its tags (appVersion) do not.
        target="$target_registry/${one##*/}"
        podman tag "$one" "$target"
        log "pushing $target ..."
        podman push -q "${tls[@]}" "$target" >&2
        echo "$target"
    done
}

# One build or base at a time per store (make image and a test run may overlap).
lock() { mkdir -p "$state"; exec 9>"$state/.lock"; flock 9; }

cmd="${1:-}"
shift || true
case "$cmd" in
    name) image_name "${1:-}" ;;
    base) lock; setup_podman; make_base ;;
    build)
        lock
        setup_podman
        make_base
        case "${1:-all}" in
            all) build engine; build control-plane ;;
            engine) build engine ;;
            # The control-plane image takes the bundled tokenizer from the engine image.
            control-plane)
                podman image exists "$(image_name engine)" || build engine
                build control-plane
                ;;
            *) die "build what? engine, control-plane or all" ;;
        esac
        ;;
    archive) [[ -n "${1:-}" ]] || die "archive to where? tools/images.sh archive PATH"
        setup_podman; archive "$@" ;;
    push) setup_podman; push "$@" ;;
    # Not exec: the EXIT trap removes the temporary folder after podman.
    podman) setup_podman; podman "$@" ;;
    *) awk 'NR > 1 && !/^#/ {exit} NR > 1' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
