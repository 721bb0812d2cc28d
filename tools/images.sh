#!/usr/bin/env bash
# Builds kvscale's two images with podman (no Docker daemon, no registry needed):
#   engine         Dockerfile               `kvscale serve`, torch and the bundled model
#   control-plane  Dockerfile.control-plane `kvscale operator` and `kvscale router`, no torch
#                  (it copies the bundled tokenizer out of the engine image: built after it)
#
#   tools/images.sh build [engine|control-plane|all]   build (making the base image first if needed)
#   tools/images.sh base                               make sure the base image exists
#   tools/images.sh name engine|control-plane          the image's full name
#   tools/images.sh podman ARGS...                     podman with kvscale's configuration
#
# podman's configuration and storage are kvscale's own (tools/images/containers.conf and
# storage.conf, rendered under $KVSCALE_PODMAN_DIR, default ~/.cache/kvscale/podman), never the
# user's. Build times go to stderr as `images: built NAME in Ns`.
#
# KVSCALE_IMAGE_REGISTRY (default ghcr.io/kvscale) names the images; KVSCALE_BUILD_CONTEXT
# builds from a copy of the checkout instead of the checkout.
# BASE_IMAGE (default docker.io/library/python:3.11-slim) is the Dockerfiles' base. When it is not
# in the local storage and cannot be pulled, an equivalent is made from Debian packages with
# debootstrap (Debian's python3 3.11, pip, venv) and tagged under that name.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
state="${KVSCALE_PODMAN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvscale/podman}"
version="$(awk -F'"' '/^version = /{print $2; exit}' "$repo_root/pyproject.toml")"
registry="${KVSCALE_IMAGE_REGISTRY:-ghcr.io/kvscale}"
base_image="${BASE_IMAGE:-docker.io/library/python:3.11-slim}"
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
    export TMPDIR="$state/tmp"  # layers are big; not /tmp
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
    log "pulling $base_image ..."
    if timeout 120 podman pull -q "$base_image" >/dev/null 2>&1; then
        return
    fi
    command -v debootstrap >/dev/null || die "cannot pull $base_image and debootstrap is not installed"
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
    podman) setup_podman; exec podman "$@" ;;
    *) sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
