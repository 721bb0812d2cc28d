"""Third-party CRDs for tests only, taken from their projects' released Go modules through the Go
module proxy (the toolchain tools/k8s-bins.sh already needs), checksum-verified by
`go mod download`, and cached under ~/.cache/kvscale/<name>-crds so a second run reads no network.
Never shipped: the chart leaves GIE's CRDs to the gateway's installation (docs/gateway.md) and
LeaderWorkerSet to its own (docs/operator.md, "A replica over several nodes").

- The Gateway API Inference Extension's InferencePool (`sigs.k8s.io/gateway-api-inference-extension`).
- The LeaderWorkerSet (`sigs.k8s.io/lws`). Its controller is not run here: it needs its webhook's
  certificates and a long Go build, so tests read what the apiserver stores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ModuleCrd:
    cache_name: str  # ~/.cache/kvscale/<cache_name>/<version>/
    module: str
    version: str
    path: str  # the CRD's YAML inside the module

    @property
    def name(self) -> str:
        """The CRD's metadata.name (plural.group), from its file name as controller-gen writes it."""
        group, plural = Path(self.path).stem.split("_", 1)
        return f"{plural}.{group}"


INFERENCE_POOL = ModuleCrd("gie-crds", "sigs.k8s.io/gateway-api-inference-extension", "v1.0.2",
                           "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml")
LEADER_WORKER_SET = ModuleCrd("lws-crds", "sigs.k8s.io/lws", "v0.7.0",
                              "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml")


def cache_dir(crd: ModuleCrd) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "kvscale" / crd.cache_name / crd.version


def module_crd(crd: ModuleCrd) -> Path:
    """The CRD's YAML file, fetched once; raises (never skips) when it cannot be had."""
    cached = cache_dir(crd) / Path(crd.path).name
    if cached.is_file():
        return cached
    go = shutil.which("go")
    if go is None:
        raise RuntimeError(f"Go is not on PATH: it fetches {crd.module}'s CRD (tests/cluster/module_crds.py)")
    proc = subprocess.run([go, "mod", "download", "-json", f"{crd.module}@{crd.version}"],
                          capture_output=True, text=True, check=False, cwd=Path.home())
    if proc.returncode != 0:
        raise RuntimeError(f"go mod download {crd.module}@{crd.version} failed: {proc.stdout}{proc.stderr}")
    source = Path(json.loads(proc.stdout)["Dir"]) / crd.path
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".partial")
    shutil.copyfile(source, partial)
    partial.replace(cached)  # never a half-written file that looks finished
    return cached


def inference_pool_crd() -> Path:
    return module_crd(INFERENCE_POOL)


def leader_worker_set_crd() -> Path:
    return module_crd(LEADER_WORKER_SET)


@contextmanager
def namespace_without(k8s_env: Any, crd: ModuleCrd, prefix: str) -> Iterator[str]:
    """A fresh namespace on a cluster with kvscale's CRDs and RBAC but not ``crd`` (a test installs
    it when it wants it); the namespace and ``crd`` removed after."""
    path = module_crd(crd)  # fetched before the clock matters (cached after the first run)
    k8s_env.kubectl("delete", "crd", crd.name, "--ignore-not-found")
    k8s_env.kubectl("apply", "-f", str(REPO_ROOT / "crds"), "-f", str(REPO_ROOT / "deploy" / "rbac.yaml"))
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    k8s_env.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        k8s_env.kubectl("delete", "namespace", name, "--wait=false", check=False)
        k8s_env.kubectl("delete", "-f", str(path), "--ignore-not-found", "--wait=false", check=False)
