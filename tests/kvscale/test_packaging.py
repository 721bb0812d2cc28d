"""Packaging: the control plane (operator, router) runs without torch.

The control-plane image installs `kvscale[control-plane]`, which has no torch; these tests keep the
code paths it runs from importing torch even where torch is installed (here), so the image cannot
break by an import creeping in. The image itself is tested in tests/images/.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE_ONLY = {"torch", "triton", "accelerate", "safetensors"}

_NO_TORCH_PROBE = """
import contextlib, io, json, sys

# torch and the engine's libraries made unimportable, as in the image: `import torch` raises
# ImportError and importlib.util.find_spec says it is absent.
for engine_only in ("torch", "triton", "accelerate", "safetensors"):
    sys.modules[engine_only] = None
import kvscale
from kvscale.cli import main
for command in ("router", "operator"):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main([command, "--help"])
import kvscale.operator.registration, kvscale.router.app
from kvscale.router.app import Router
from kvscale.router.config import RouterConfig
from kvscale.tokenization import chat_prompt_token_ids, completion_prompt_token_ids
router = Router(RouterConfig(replicas=["http://127.0.0.1:9"]))
router.hasher.load_tokenizers()  # what the router does before serving
tokenizer = router.hasher.tokenizers["smollm2-135m-instruct"]
ids = {
    "completion": completion_prompt_token_ids(tokenizer, "The capital of France is"),
    "chat": chat_prompt_token_ids(tokenizer, [{"role": "user", "content": "Hi there"}]),
}
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton", "accelerate")
               and sys.modules[m] is not None)
print(json.dumps({"heavy": heavy, "ids": ids}))
"""


def _pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def _closure(extras: dict[str, list[str]], group: str) -> set[str]:
    """Distribution names a group installs, following kvscale[...] self-references."""
    names: set[str] = set()
    for requirement in extras[group]:
        name = requirement.split("[")[0].split("=")[0].strip().lower()
        if name == "kvscale":
            for inner in requirement.split("[", 1)[1].rstrip("]").split(","):
                names |= _closure(extras, inner.strip())
        else:
            names.add(name)
    return names


def test_control_plane_group_has_no_engine_dependencies():
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    assert project["dependencies"] == []  # `import kvscale` needs nothing
    control_plane = _closure(extras, "control-plane")
    assert {"kopf", "transformers", "jinja2", "kubernetes"} <= control_plane
    assert not control_plane & ENGINE_ONLY
    assert ENGINE_ONLY <= _closure(extras, "engine")
    assert _closure(extras, "all") == _closure(extras, "engine") | control_plane


def test_every_pin_is_the_same_in_every_group():
    pins: dict[str, set[str]] = {}
    for group in _pyproject()["project"]["optional-dependencies"].values():
        for requirement in group:
            if "==" in requirement:
                name, version = requirement.split("==")
                pins.setdefault(name.split("[")[0].lower(), set()).add(version)
    assert {name: v for name, v in pins.items() if len(v) > 1} == {}


@pytest.mark.parametrize("cache", ["converted", "tokenizer-only"])
def test_cli_and_router_tokenizer_never_import_torch(cache, tmp_path, bundled_cache_dirs):
    """`kvscale router/operator --help`, their modules and the bundled tokenizer, in a fresh
    interpreter where torch and the engine's libraries cannot be imported, with the converted model in the cache or the tokenizer
    alone (what the control-plane image ships)."""
    env = {"KVSCALE_CACHE": str(bundled_cache_dirs[cache]), "PATH": "/usr/bin:/bin",
           "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)}
    probe = subprocess.run([sys.executable, "-c", _NO_TORCH_PROBE], capture_output=True,
                           text=True, timeout=300, env=env, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert result["ids"] == bundled_cache_dirs["engine_ids"]


@pytest.fixture(scope="module")
def bundled_cache_dirs(tmp_path_factory) -> dict:
    """Two caches: the full conversion the engine makes, and the tokenizer taken alone from the
    GGUF; plus the ids the engine's own tokenizer (transformers' AutoTokenizer) gives."""
    from transformers import AutoTokenizer

    from kvscale import model_files
    from kvscale.tokenization import chat_prompt_token_ids, completion_prompt_token_ids

    converted = model_files.resolve_model_path(None)  # the session's usual cache
    tokenizer_only = tmp_path_factory.mktemp("tokenizer-cache")
    out = subprocess.run(
        [sys.executable, "-c",
         "from kvscale.model_files import resolve_tokenizer_path as r; print(r(None))"],
        capture_output=True, text=True, timeout=300,
        env={"KVSCALE_CACHE": str(tokenizer_only), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
             "HOME": str(tokenizer_only)},
    )
    assert out.returncode == 0, out.stderr
    extracted = Path(out.stdout.strip().splitlines()[-1])
    assert extracted.parent == tokenizer_only / "models"
    assert not (extracted / "model.safetensors").exists()  # the tokenizer alone

    reference = AutoTokenizer.from_pretrained(str(converted))
    return {
        "converted": converted.parent.parent,
        "tokenizer-only": tokenizer_only,
        "engine_ids": {
            "completion": completion_prompt_token_ids(reference, "The capital of France is"),
            "chat": chat_prompt_token_ids(reference, [{"role": "user", "content": "Hi there"}]),
        },
    }
