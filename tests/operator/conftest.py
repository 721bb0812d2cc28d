"""Fixtures for the operator tests (the control plane, `k8s_env`, is in tests/conftest.py).

The operator tests import their helpers (metric endpoints, the operator subprocess) from
operator_helpers.py next to this file; with --import-mode=importlib it is not on sys.path.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
