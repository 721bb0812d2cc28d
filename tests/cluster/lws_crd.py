"""The LeaderWorkerSet CRD, for tests only: taken from the released Go module `sigs.k8s.io/lws`
through the Go module proxy (the toolchain tools/k8s-bins.sh already needs), checksum-verified by
`go mod download`, and cached under ~/.cache/kvscale/lws-crds so a second run reads no network.
Never shipped: LWS is installed apart from the chart (docs/operator.md, "A replica over several
nodes"). Its controller is not run here: it needs its webhook's certificates and a long Go build.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

LWS_MODULE = "sigs.k8s.io/lws"
LWS_VERSION = "v0.7.0"
LWS_CRD_PATH = "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "kvscale" / "lws-crds" / LWS_VERSION


def leader_worker_set_crd() -> Path:
    """The CRD's YAML file, fetched once; raises (never skips) when it cannot be had."""
    cached = cache_dir() / Path(LWS_CRD_PATH).name
    if cached.is_file():
        return cached
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("Go is not on PATH: it fetches the LeaderWorkerSet CRD (tests/cluster/lws_crd.py)")
    proc = subprocess.run([go, "mod", "download", "-json", f"{LWS_MODULE}@{LWS_VERSION}"],
                          capture_output=True, text=True, check=False, cwd=Path.home())
    if proc.returncode != 0:
        raise RuntimeError(f"go mod download {LWS_MODULE}@{LWS_VERSION} failed: {proc.stdout}{proc.stderr}")
    source = Path(json.loads(proc.stdout)["Dir"]) / LWS_CRD_PATH
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".partial")
    shutil.copyfile(source, partial)
    partial.replace(cached)  # never a half-written file that looks finished
    return cached
