"""The real-node lane (nodeenv.py): root, containerd, ~7 GB of images and several minutes, so it
is collected only when asked for: `make test-node` sets KVSCALE_NODE_LANE=1. Without it the
module is not collected at all (never a skip: nothing here is reported as passed)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

collect_ignore = [] if os.environ.get("KVSCALE_NODE_LANE") == "1" else ["test_node.py"]
