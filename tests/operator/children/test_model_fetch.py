"""The hf:// init container, run with the real `hf` CLI.

The image sets HF_HUB_OFFLINE=1 for the server, which must never download; the init container
that fetches an hf:// model must turn it off again, or it fails without a request. The Hub cannot
be reached from here, so a local HTTP server stands in for it and records what the CLI asks.
"""

from __future__ import annotations

import http.server
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from kvscale.operator.children.servers import build_deployment
from kvscale.operator.spec import parse_spec

REPO_ROOT = Path(__file__).resolve().parents[3]


def image_env(dockerfile: Path) -> dict[str, str]:
    """The ENV the engine image sets (what every container inherits before its own env)."""
    text = dockerfile.read_text()
    return dict(re.findall(r"\b(HF_HUB_OFFLINE)=(\S+)", text))


def test_hf_init_container_reaches_the_hub_with_the_real_cli(tmp_path: Path) -> None:
    requests: list[str] = []

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            requests.append(self.path)
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("X-Error-Code", "RepoNotFound")
            self.end_headers()
            self.wfile.write(b'{"error": "Repository not found"}')

        do_HEAD = do_GET

        def log_message(self, *args) -> None:
            pass

    hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    try:
        spec = parse_spec({"model": {"uri": "hf://org/tiny"}})
        pod = build_deployment("tiny", "ns", spec)["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        inherited = image_env(REPO_ROOT / "Dockerfile")
        assert inherited.get("HF_HUB_OFFLINE") == "1", "the image is meant to keep servers offline"
        # Kubernetes: the container's env overrides the image's.
        env = {**inherited, **{e["name"]: e["value"] for e in init["env"]}}
        paths = {"/models": str(tmp_path / "models")}
        command = [re.sub("^/models", paths["/models"], arg) for arg in init["command"]]
        env = {key: re.sub("^/models", paths["/models"], value) for key, value in env.items()}
        hf = Path(sys.executable).with_name(command[0])
        done = subprocess.run(
            [str(hf), *command[1:]], capture_output=True, text=True, timeout=120,
            env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), **env,
                 "HF_ENDPOINT": f"http://127.0.0.1:{hub.server_port}"})
    finally:
        hub.shutdown()
    output = done.stdout + done.stderr
    assert "offline" not in output.lower(), output
    assert any("org/tiny" in path for path in requests), (requests, output)
