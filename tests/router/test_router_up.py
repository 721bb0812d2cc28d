"""`kvscale up`: Redis, replicas and router come up together and all go away on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-up-never-on-argv"


def children_of(pid: int) -> set[int]:
    """Every live descendant of ``pid``, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields restart after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` is alive and not a zombie. A process can exit between any two reads of its
    /proc entry, so a vanished entry at either read means it is gone (a CI run once lost this
    race: ProcessLookupError reading /proc/<pid>/stat after /proc/<pid> existed)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return not state.startswith("Z")


def test_up_serves_through_the_router_and_stops_cleanly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The key reaches `kvscale up` as its environment, as a user's secret would.
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               KVSCALE_API_KEY=API_KEY)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvscale", "up", "--replicas", "2", "--port", str(port),
         "--num-gpu-blocks-override", "64", "--max-model-len", "512", "--max-num-seqs", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(REPO),
    )
    lines: list[str] = []
    listed = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops everything." in line:  # the last line of the list after "ready"
                listed.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert listed.wait(400), "".join(lines)
        output = "".join(lines)
        assert "kvscale up: ready" in output
        assert f"router:   http://127.0.0.1:{port}/v1" in output
        replica_urls = re.findall(r"replica-\d: (http://127\.0\.0\.1:\d+)/v1", output)
        assert len(replica_urls) == 2
        assert "redis-server at redis://127.0.0.1:" in output
        descendants = children_of(proc.pid)
        assert len(descendants) >= 4  # redis, 2 replicas, router
        # The key never sits on a command line, where any local user reads it.
        for pid in descendants:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            assert API_KEY not in cmdline, cmdline

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY)
        completion = client.completions.create(
            model="smollm2-135m-instruct", prompt="The sky is", max_tokens=4, temperature=0
        )
        assert completion.choices[0].text
        for url in replica_urls:
            direct = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY)
            assert [m.id for m in direct.models.list().data] == ["smollm2-135m-instruct"]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        reader.join(5)
        assert "kvscale up: all stopped" in "".join(lines)
        still = [pid for pid in descendants if _running(pid)]
        assert still == [], f"orphans left running: {still}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
