#!/usr/bin/env bash
# Install the Debian packages whose real services the tests start (redis-server, prometheus
# with promtool for the observability tests).
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
{ command -v prometheus && command -v promtool; } >/dev/null || need+=(prometheus)
# The image tests build and run kvscale's images with podman (runc: crun fails on hybrid cgroups;
# debootstrap makes the base image when no registry is reachable).
for tool in podman buildah runc debootstrap; do
    command -v "$tool" >/dev/null || need+=("$tool")
done
# A real registry on loopback for the `make image-push` test.
command -v docker-registry >/dev/null || need+=(docker-registry)
# The engine's CPU decode attention is C compiled on first use (kernels/cpu_native.py); its tests
# insist that it builds.
command -v cc >/dev/null || need+=(gcc libc6-dev)
# `podman run --init` (signals reach the server, as in a pod) needs catatonit, a podman Recommends.
[ -x /usr/libexec/podman/catatonit ] || need+=(catatonit)
# The real-node lane (make test-node): containerd (with runc) and the CNI plugins, from Debian.
command -v containerd >/dev/null || need+=(containerd)
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "system-deps: installing ${need[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
