"""The router's tokenizers for any model the servers serve.

A router must hash prompts exactly as the servers do, under the names the servers answer to: the
bundled model under a `servedName`, a model directory (what `pvc://` and `hf://` become in a pod),
and, when a tokenizer cannot be loaded, a router that says so (log, /health, a metric) instead of
quietly routing by load alone.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvscale.metric_names import ROUTER_FALLBACKS, ROUTER_TOKENIZER_LOADED
from kvscale.model_files import BUNDLED_NAME, resolve_tokenizer_path
from kvscale.router.cli_router import add_arguments, config_from_args
from kvscale.router.prefix_hashes import PrefixHasher

PROMPT = "The lighthouse keeper counted ships " * 8


def sample(text: str, series: str, **labels: str) -> float | None:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{series}{{{wanted}}} ") or (not labels and line.startswith(f"{series} ")):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_served_model_names_map_to_the_models_tokenizer() -> None:
    hasher = PrefixHasher([None], served_names=["my-chat", "chat-alias"])
    hasher.load_tokenizers()
    assert set(hasher.tokenizers) == {"my-chat", "chat-alias"}
    default = PrefixHasher([None])
    default.load_tokenizers()
    expected = default.prompt_block_hashes("completions", {"prompt": PROMPT}, BUNDLED_NAME)
    for name in ("my-chat", "chat-alias"):
        got = hasher.prompt_block_hashes("completions", {"prompt": PROMPT}, name)
        assert got.hashes and got == expected
    assert hasher.tokenizer_status() == {"my-chat": None, "chat-alias": None}


def test_a_model_directory_is_tokenized_under_its_folder_name_or_served_name(tmp_path: Path) -> None:
    # What a pvc:// or hf:// model is inside the pod: a folder with the tokenizer files.
    folder = tmp_path / "tiny-llama"
    folder.symlink_to(resolve_tokenizer_path(None), target_is_directory=True)
    by_folder = PrefixHasher([str(folder)])
    by_folder.load_tokenizers()
    assert list(by_folder.tokenizers) == ["tiny-llama"]
    named = PrefixHasher([str(folder)], served_names=["team/llama"])
    named.load_tokenizers()
    assert named.prompt_block_hashes("completions", {"prompt": PROMPT}, "team/llama").hashes


def test_a_tokenizer_that_cannot_load_is_reported_not_fatal(tmp_path: Path) -> None:
    reasons: list[str] = []
    hasher = PrefixHasher([str(tmp_path / "nowhere")], served_names=["lost"], on_fallback=reasons.append)
    hasher.load_tokenizers()  # the router still starts and routes by load
    (error,) = hasher.tokenizer_status().values()
    assert error and "nowhere" in error
    assert hasher.prompt_block_hashes("completions", {"prompt": PROMPT}, "lost").hashes == []
    assert reasons == ["no_tokenizer"]


def test_served_model_names_need_exactly_one_model() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--replicas", "http://127.0.0.1:1"]
    config = config_from_args(parser.parse_args([*base, "--served-model-name", "a", "b"]))
    assert config.models == [None] and config.served_model_names == ["a", "b"]
    with pytest.raises(SystemExit, match="--served-model-name"):
        config_from_args(parser.parse_args(
            [*base, "--model", "/x", "--model", "/y", "--served-model-name", "a"]))


@pytest.mark.slow
def test_router_without_its_tokenizer_says_so_in_health_and_metrics(launcher, tmp_path: Path) -> None:
    replica = launcher.replica(None, "lost", extra=["--served-model-name", "lost"])
    router = launcher.router([replica.url], None,
                             extra=["--model", str(tmp_path / "missing"), "--served-model-name", "lost"])
    body = httpx.get(f"{router.url}/health", timeout=5).json()
    (entry,) = body["tokenizers"]
    assert entry["model"] == "lost" and entry["loaded"] is False and "missing" in entry["error"]
    metrics = httpx.get(f"{router.url}/metrics", timeout=5).text
    assert sample(metrics, ROUTER_TOKENIZER_LOADED.series, model_name="lost") == 0.0
    response = httpx.post(f"{router.url}/v1/completions", timeout=60,
                          json={"model": "lost", "prompt": PROMPT, "max_tokens": 1})
    assert response.status_code == 200, response.text  # routed by load, as before
    metrics = httpx.get(f"{router.url}/metrics", timeout=5).text
    assert sample(metrics, ROUTER_FALLBACKS.series, reason="no_tokenizer") == 1.0
    log = router.log_tail(100_000)
    assert any("ERROR" in line and "tokenizer" in line and "lost" in line
               for line in log.splitlines()), log
