"""The benchmark harness (bench/, at the repository root) is imported by its package name.

Appended, not prepended: the root's kvscale/ folder must not shadow the installed package."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])
if REPO not in sys.path:
    sys.path.append(REPO)
