"""`kvscale router --log-level debug` logs the router's own records (every decision), not the
HTTP client's trace of each request under them."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, logging
from kvscale.router.cli_router import configure_logging
configure_logging({level!r})
print(json.dumps({{name: logging.getLogger(name).isEnabledFor(logging.DEBUG)
                  for name in ("kvscale.router.decision", "httpcore.http11", "httpx")}}))
"""


def debug_enabled(level: str) -> dict[str, bool]:
    # A process of its own: logging.basicConfig does nothing where the root logger has handlers
    # (pytest's).
    out = subprocess.run([sys.executable, "-c", PROBE.format(level=level)], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_debug_turns_on_the_routers_records_and_leaves_the_http_client_quiet():
    assert debug_enabled("debug") == {"kvscale.router.decision": True, "httpcore.http11": False, "httpx": False}
    assert debug_enabled("info")["kvscale.router.decision"] is False
