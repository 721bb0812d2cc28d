"""The generated Redis password never reaches a command line, and still guards the index.

A kubelet expands `$(VAR)` in a container's args before the runtime starts it, so whatever an
env var holds ends up in the container's recorded config and in /proc/PID/cmdline. The Redis
Deployment is expanded here as the test kubelet (tests/cluster/kubelet.py) does, and the real
redis-server runs with the result.
"""

from __future__ import annotations

import base64
import shutil
import subprocess

import pytest
import redis
from kubelet import expand

from kvscale.operator.children.redis import build_redis_deployment, build_redis_secret
from kvscale.processes import die_with_parent, free_port, wait_until


def expanded_redis_argv(secret: dict) -> tuple[list[str], dict[str, str]]:
    """redis-server's argv as a kubelet starts it, with the Secret's keys where env names them."""
    data = {key: base64.b64encode(value.encode()).decode()
            for key, value in secret["stringData"].items()}
    container = build_redis_deployment("chat", "team", "redis:7")["spec"]["template"]["spec"]["containers"][0]
    env: dict[str, str] = {}
    for var in container["env"]:
        ref = var["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"]
        env[var["name"]] = base64.b64decode(data[ref["key"]]).decode()
    argv = [expand(arg, env) for arg in container["command"] + container["args"]]
    return argv, env


def test_the_password_is_not_on_the_command_line_and_still_required():
    secret = build_redis_secret("chat", "team")
    password = secret["stringData"]["password"]
    argv, env = expanded_redis_argv(secret)
    assert password not in " ".join(argv)
    assert all(password not in value for value in env.values())  # Redis's env holds the hash only

    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is needed (Debian's redis-server package)"
    port = free_port()
    argv[0] = binary
    argv[argv.index("--port") + 1] = str(port)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=die_with_parent)
    try:
        def answers() -> bool:
            try:
                return bool(redis.Redis(port=port, password=password, socket_timeout=2).ping())
            except redis.ConnectionError:
                return False

        wait_until(answers, 20, interval=0.1, what="redis-server answering with the password")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=2).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password=password + "x", socket_timeout=2).ping()
        with open(f"/proc/{proc.pid}/cmdline", "rb") as cmdline:
            assert password.encode() not in cmdline.read()
    finally:
        proc.terminate()
        proc.wait(10)
