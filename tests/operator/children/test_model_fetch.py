"""The hf:// init containers, run with the real `hf` CLI: the servers' (the whole model) and the
routers' (the tokenizer alone).

The image sets HF_HUB_OFFLINE=1 for the server, which must never download; the init container
that fetches an hf:// model must turn it off again, or it fails without a request. The Hub cannot
be reached from here, so a local HTTP server stands in for it (tests/operator/hub.py) and records
what the CLI asks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from hub import HubStandIn

from kvscale.model_files import resolve_tokenizer_path
from kvscale.operator.children.router import build_router_deployment, service_router
from kvscale.operator.children.servers import build_deployment
from kvscale.operator.spec import parse_spec
from kvscale.router.prefix_hashes import PrefixHasher

REPO_ROOT = Path(__file__).resolve().parents[3]


def image_env(dockerfile: Path) -> dict[str, str]:
    """The ENV the engine image sets (what every container inherits before its own env)."""
    text = dockerfile.read_text()
    return dict(re.findall(r"\b(HF_HUB_OFFLINE)=(\S+)", text))


def run_init_container(init: dict, tmp_path: Path, hub: HubStandIn) -> subprocess.CompletedProcess:
    """The init container's command with the real `hf` CLI, /models mapped under ``tmp_path``."""
    inherited = image_env(REPO_ROOT / "Dockerfile")
    assert inherited.get("HF_HUB_OFFLINE") == "1", "the image is meant to keep servers offline"
    # Kubernetes: the container's env overrides the image's.
    env = {**inherited, **{e["name"]: e["value"] for e in init["env"]}}
    models = str(tmp_path / "models")
    command = [re.sub("^/models", models, arg) for arg in init["command"]]
    env = {key: re.sub("^/models", models, value) for key, value in env.items()}
    hf = Path(sys.executable).with_name(command[0])
    return subprocess.run(
        [str(hf), *command[1:]], capture_output=True, text=True, timeout=120,
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), **env, "HF_ENDPOINT": hub.url})


def test_hf_init_container_reaches_the_hub_with_the_real_cli(tmp_path: Path) -> None:
    hub = HubStandIn().start()  # holds no repo: every answer is the Hub's RepoNotFound
    try:
        spec = parse_spec({"model": {"uri": "hf://org/tiny"}})
        pod = build_deployment("tiny", "ns", spec)["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        done = run_init_container(init, tmp_path, hub)
    finally:
        hub.stop()
    output = done.stdout + done.stderr
    assert "offline" not in output.lower(), output
    assert any("org/tiny" in path for path in hub.requests), (hub.requests, output)


def test_the_router_fetches_the_tokenizer_alone_and_tokenizes_as_the_servers(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    for file in resolve_tokenizer_path(None).iterdir():
        (repo / file.name).symlink_to(file)
    weights = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for name in weights:
        (repo / name).write_bytes(b"\0" * 4096)
    spec = parse_spec({"model": {"uri": "hf://org/tiny"}})
    server_pod = build_deployment("tiny", "ns", spec)["spec"]["template"]["spec"]
    router_pod = build_router_deployment(service_router("tiny", "ns", spec, "img"))
    router_pod_spec = router_pod["spec"]["template"]["spec"]
    (init,) = router_pod_spec["initContainers"]
    hub = HubStandIn({"org/tiny": repo}).start()
    try:
        done = run_init_container(init, tmp_path / "router", hub)
        assert done.returncode == 0, done.stdout + done.stderr
        fetched = hub.files_fetched("org/tiny")
        run_init_container(server_pod["initContainers"][0], tmp_path / "server", hub)
    finally:
        hub.stop()
    assert fetched and not fetched & set(weights), fetched
    assert "tokenizer.json" in fetched and "tokenizer_config.json" in fetched
    # The router's --model is where its init container put the files, the servers' path too.
    args = router_pod_spec["containers"][0]["args"]
    model_dir = args[args.index("--model") + 1]
    server_args = server_pod["containers"][0]["args"]
    assert model_dir == server_args[server_args.index("--model") + 1]
    local = tmp_path / "router" / model_dir.removeprefix("/")
    assert all((tmp_path / "server" / model_dir.removeprefix("/") / name).is_file() for name in weights)
    hasher = PrefixHasher([str(local)], served_names=[spec.model.served_name])
    hasher.load_tokenizers()
    bundled = PrefixHasher([None])
    bundled.load_tokenizers()
    body = {"prompt": "The lighthouse keeper counted ships " * 8}
    assert hasher.prompt_block_hashes("completions", body, "tiny").hashes == \
        bundled.prompt_block_hashes("completions", body, None).hashes != []
