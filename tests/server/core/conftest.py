"""scheduler_helpers.py next to this file; with --import-mode=importlib it is not on sys.path."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
