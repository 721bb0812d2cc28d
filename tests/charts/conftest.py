"""Helm from the same cache as the control plane (tools/k8s-bins.sh builds it from its Go module)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chart_helpers import Helm  # noqa: E402


@pytest.fixture(scope="session")
def helm(k8s_bins: Path) -> Helm:
    binary = k8s_bins / "helm"
    assert os.access(binary, os.X_OK), f"no helm in {k8s_bins} (tools/k8s-bins.sh builds it)"
    return Helm(binary)
