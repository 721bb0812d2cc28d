#!/usr/bin/env bash
# Install the Debian packages whose real services the tests start (redis-server).
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "system-deps: installing ${need[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
