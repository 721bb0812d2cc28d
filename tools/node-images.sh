#!/usr/bin/env bash
# The images the real-node lane (tests/node) needs beside kvscale's own two, made without a
# registry and kept in kvscale's podman store (tools/images.sh podman):
#   pause  the pod sandbox: Debian's static catatonit in pause mode (`catatonit -P`), alone
#   redis  Debian's redis-server on a debootstrap minbase (the KV index the operator runs)
# and how all four get into a containerd.
#
#   tools/node-images.sh make                     make pause and redis if missing
#   tools/node-images.sh name pause|redis         the image's full name
#   tools/node-images.sh save-oci DIR NAME        save NAME into the OCI layout DIR, reusing the
#                                                 blobs DIR already has (the lane's image cache)
#   tools/node-images.sh import SOCKET [NAME...]  stream images whole into the containerd at
#                                                 SOCKET (default: pause, redis, engine,
#                                                 control-plane): `podman save` through a named
#                                                 pipe into `ctr -n k8s.io images import -`
#
# The lane (tests/node/nodeenv.py) uses save-oci: an OCI layout per image that persists between
# runs, so a rebuilt image costs podman only its changed layers, and containerd is sent only the
# layers it has no snapshot of (docs/k8s-test-env.md, "Real-node lane"). `import` sends every
# layer every time; it stays for a containerd of one's own.
#
# Names live under localhost/kvscale-node/, so they never shadow an official image.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
images="$repo_root/tools/images.sh"
debian_suite="${DEBIAN_SUITE:-bookworm}"
state="${KVSCALE_PODMAN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvscale/podman}"

log() { echo "node-images: $*" >&2; }
die() { log "error: $*"; exit 1; }
pm() { bash "$images" podman "$@"; }

# The tag names what is inside, so a new Debian package gives a new image.
pause_name() {
    command -v catatonit >/dev/null || die "catatonit is not installed (make system-deps)"
    echo "localhost/kvscale-node/pause:$(dpkg-query -W -f='${Version}' catatonit | tr '+~:' '---')"
}
redis_name() {
    local v
    v="$(apt-cache policy redis-server | awk '/Candidate:/ {print $2}')"
    [[ -n "$v" && "$v" != "(none)" ]] || die "apt knows no redis-server package"
    echo "localhost/kvscale-node/redis:$(echo "$v" | tr '+~:' '---')"
}

make_pause() {
    local name tmp
    name="$(pause_name)"
    pm image exists "$name" && return
    tmp="$(mktemp -d)"
    cp "$(command -v catatonit)" "$tmp/pause"
    # Pause mode: no child, waits for a signal, reaps nothing but itself (the sandbox's job).
    tar -C "$tmp" -c . | pm import --change 'ENTRYPOINT ["/pause", "-P"]' - "$name" >/dev/null
    rm -rf "$tmp"
    log "made $name"
}

make_redis() {
    local name rootfs mirror t0=$SECONDS
    name="$(redis_name)"
    pm image exists "$name" && return
    command -v debootstrap >/dev/null || die "debootstrap is not installed (make system-deps)"
    mirror="$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' \
        /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)"
    mirror="${mirror:-http://deb.debian.org/debian}"
    mkdir -p "$state/tmp"
    rootfs="$(mktemp -d "$state/tmp/redis-rootfs.XXXXXX")"
    log "building $name from Debian $debian_suite ($mirror) ..."
    debootstrap --variant=minbase --include=redis-server "$debian_suite" "$rootfs" "$mirror" \
        >"$rootfs.log" 2>&1 || die "debootstrap failed (see $rootfs.log)"
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/usr/share/{doc,man,info,locale}/*
    tar -C "$rootfs" -c . | pm import --change 'CMD ["redis-server"]' - "$name" >/dev/null
    rm -rf "$rootfs" "$rootfs.log"
    log "made $name in $((SECONDS - t0))s"
}

import_into() {
    local socket="$1"; shift
    local names=("$@") name t0
    if [[ ${#names[@]} -eq 0 ]]; then
        names=("$(pause_name)" "$(redis_name)" "$(bash "$images" name engine)"
               "$(bash "$images" name control-plane)")
    fi
    for name in "${names[@]}"; do
        pm image exists "$name" || die "$name is not in kvscale's podman store (make image / $0 make)"
        t0=$SECONDS
        stream_into "$socket" "$name" || die "importing $name into $socket failed"
        log "imported $name in $((SECONDS - t0))s"
    done
}

# Through a named pipe: `podman save` to stdout first stages the whole archive (~6 GB for the
# engine) in a temporary file; to a path (the pipe) it writes as it reads the layers.
stream_into() {
    local socket="$1" name="$2" pipe_dir saved=0 imported=0
    pipe_dir="$(mktemp -d)"
    mkfifo "$pipe_dir/archive"
    ctr -a "$socket" -n k8s.io images import - <"$pipe_dir/archive" >/dev/null &
    local importer=$!
    pm save -o "$pipe_dir/archive" "$name" >/dev/null || saved=$?
    if [[ $saved -ne 0 ]]; then
        # A save that failed before opening the pipe leaves the importer waiting to open it:
        # one open for writing lets it see the end of the stream (none when it has gone).
        timeout 5 bash -c ': >"$1"' _ "$pipe_dir/archive" || true
    fi
    wait "$importer" || imported=$?
    rm -rf "$pipe_dir"
    [[ $saved -eq 0 && $imported -eq 0 ]]
}

# Uncompressed, so a layer's digest is its diff ID and containerd's snapshot of it can be found
# from the config alone (its chain ID). Into an existing layout podman writes only the blobs that
# are missing (the control-plane image unchanged: 0.5 s); blobs no longer referenced stay, and
# the caller prunes them.
save_oci() {
    local dir="$1" name="$2" t0=$SECONDS
    pm image exists "$name" || die "$name is not in kvscale's podman store (make image / $0 make)"
    mkdir -p "$dir"
    pm save --quiet --uncompressed --format oci-dir -o "$dir" "$name" >/dev/null \
        || die "saving $name into $dir failed"
    log "saved $name into $dir in $((SECONDS - t0))s"
}

cmd="${1:-}"
shift || true
case "$cmd" in
    make) make_pause; make_redis ;;
    name)
        case "${1:-}" in
            pause) pause_name ;;
            redis) redis_name ;;
            *) die "name of what? pause or redis" ;;
        esac
        ;;
    save-oci) [[ $# -eq 2 ]] || die "save-oci DIR NAME"; save_oci "$@" ;;
    import) [[ $# -ge 1 ]] || die "import SOCKET [NAME...]"; import_into "$@" ;;
    *) sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
