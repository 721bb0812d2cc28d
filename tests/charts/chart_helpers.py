"""Helm for the chart tests: the binary tools/k8s-bins.sh builds from its Go module, run with
a throwaway config, and the chart's rendered manifests."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "charts" / "kvscale"


@dataclass(frozen=True)
class Helm:
    binary: Path
    kubeconfig: Path | None = None

    def run(self, *args: str, check: bool = True, input: str | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.binary), *args]
        if self.kubeconfig is not None:
            cmd.append(f"--kubeconfig={self.kubeconfig}")
        # Helm's own config and cache go to a throwaway place, not the user's.
        env = {**os.environ, "HELM_CONFIG_HOME": "/tmp/kvscale-helm/config",
               "HELM_CACHE_HOME": "/tmp/kvscale-helm/cache", "HELM_DATA_HOME": "/tmp/kvscale-helm/data"}
        proc = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout,
                              env=env, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def template(self, *values: str, release: str = "kvscale", namespace: str = "kvscale-system",
                 show_only: Sequence[str] = ()) -> list[dict]:
        """Rendered manifests (`--set` pairs in `values`), hooks included."""
        args = ["template", release, str(CHART), "--namespace", namespace]
        for value in values:
            args += ["--set", value]
        for template in show_only:
            args += ["--show-only", template]
        return [doc for doc in yaml.safe_load_all(self.run(*args).stdout) if doc]


# Every optional part of the chart switched on (the observability kinds of the Prometheus Operator
# aside: the test control plane does not serve monitoring.coreos.com; the dashboards are plain
# ConfigMaps and stay in).
ALL_ON = (
    "namespaceRouter.enabled=true",
    "namespaceRouter.redis.url=redis://kv-index.default.svc:6379/0",
    "networkPolicies.enabled=true",
    "networkPolicies.namespaces={default,kvscale-system}",
    "tests.inferenceService=chat",
    "tests.namespace=default",
    "observability.dashboards.enabled=true",
)
