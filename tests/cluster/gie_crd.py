"""The Gateway API Inference Extension's InferencePool CRD, for tests only: taken from the
released Go module `sigs.k8s.io/gateway-api-inference-extension` through the Go module proxy
(the toolchain tools/k8s-bins.sh already needs), checksum-verified by `go mod download`, and
cached under ~/.cache/kvscale/gie-crds so a second run reads no network. Never shipped: the
chart leaves GIE's CRDs to the gateway's installation (docs/gateway.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

GIE_MODULE = "sigs.k8s.io/gateway-api-inference-extension"
GIE_VERSION = "v1.0.2"
POOL_CRD_PATH = "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "kvscale" / "gie-crds" / GIE_VERSION


def inference_pool_crd() -> Path:
    """The CRD's YAML file, fetched once; raises (never skips) when it cannot be had."""
    cached = cache_dir() / Path(POOL_CRD_PATH).name
    if cached.is_file():
        return cached
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("Go is not on PATH: it fetches GIE's InferencePool CRD (tests/cluster/gie_crd.py)")
    proc = subprocess.run([go, "mod", "download", "-json", f"{GIE_MODULE}@{GIE_VERSION}"],
                          capture_output=True, text=True, check=False, cwd=Path.home())
    if proc.returncode != 0:
        raise RuntimeError(f"go mod download {GIE_MODULE}@{GIE_VERSION} failed: {proc.stdout}{proc.stderr}")
    source = Path(json.loads(proc.stdout)["Dir"]) / POOL_CRD_PATH
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".partial")
    shutil.copyfile(source, partial)
    partial.replace(cached)  # never a half-written file that looks finished
    return cached
