"""A local stand-in for the Hugging Face Hub, for the real `hf` CLI (HF_ENDPOINT=its URL).

The Hub cannot be reached from here. This serves the few routes `hf download` uses (a repo's
revision info and its files, HEAD and GET) from local folders, one per repo id, and records every
path asked for, so a test can check what was fetched and what was not. A repo it does not hold
answers 404 with the Hub's RepoNotFound code.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import shutil
import threading
from pathlib import Path
from typing import Any

REVISION_SHA = "0" * 39 + "1"


class HubStandIn:
    def __init__(self, repos: dict[str, Path] | None = None, host: str = "127.0.0.1") -> None:
        self.repos = dict(repos or {})
        self.requests: list[str] = []
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                stand_in.requests.append(self.path)
                stand_in.answer(self, body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                stand_in.requests.append(self.path)
                stand_in.answer(self, body=False)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubStandIn:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files_fetched(self, repo: str) -> set[str]:
        prefix = f"/{repo}/resolve/"
        return {p[len(prefix):].split("/", 1)[1] for p in self.requests if p.startswith(prefix)}

    # -- routes ---------------------------------------------------------------------------------
    def answer(self, handler: http.server.BaseHTTPRequestHandler, body: bool) -> None:
        path = handler.path.split("?", 1)[0]
        info = re.fullmatch(r"/api/models/(.+?)/revision/[^/]+", path)
        tree = re.fullmatch(r"/api/models/(.+?)/tree/[^/]+(?:/.*)?", path)
        resolve = re.fullmatch(r"/(.+?)/resolve/[^/]+/(.+)", path)
        repo = (info or tree or resolve).group(1) if (info or tree or resolve) else None
        folder = self.repos.get(repo or "")
        if folder is None:
            self._send(handler, 404, b'{"error": "Repository not found"}', body,
                       {"Content-Type": "application/json", "X-Error-Code": "RepoNotFound"})
            return
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        if info:
            payload = {"id": repo, "modelId": repo, "sha": REVISION_SHA, "private": False,
                       "siblings": [{"rfilename": f} for f in files]}
            self._send(handler, 200, json.dumps(payload).encode(), body,
                       {"Content-Type": "application/json"})
        elif tree:
            payload = [{"type": "file", "path": f, "size": (folder / f).stat().st_size,
                        "oid": self._etag(folder / f)} for f in files]
            self._send(handler, 200, json.dumps(payload).encode(), body,
                       {"Content-Type": "application/json"})
        else:
            assert resolve is not None
            target = folder / resolve.group(2)
            if not target.is_file():
                self._send(handler, 404, b'{"error": "Entry not found"}', body,
                           {"Content-Type": "application/json", "X-Error-Code": "EntryNotFound"})
                return
            self._send(handler, 200, b"", False,
                       {"Content-Type": "application/octet-stream", "X-Repo-Commit": REVISION_SHA,
                        "ETag": f'"{self._etag(target)}"'},
                       length=target.stat().st_size)
            if body:
                with target.open("rb") as source:  # weights are large: streamed, not read whole
                    shutil.copyfileobj(source, handler.wfile)

    @staticmethod
    def _etag(path: Path) -> str:
        stat = path.stat()
        return hashlib.sha1(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()

    @staticmethod
    def _send(handler: http.server.BaseHTTPRequestHandler, status: int, payload: bytes, body: bool,
              headers: dict[str, str], length: int | None = None) -> None:
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(payload) if length is None else length))
        handler.end_headers()
        if body:
            handler.wfile.write(payload)
