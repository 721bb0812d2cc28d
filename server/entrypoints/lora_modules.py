"""``--lora-modules`` values in vLLM's two spellings, ``name=path`` and JSON
``{"name": ..., "path": ..., "base_model_name": ...}``, and an adapter's /v1/models card
(docs/server.md, "LoRA adapters")."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvscale.server.entrypoints import protocol as p


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str  # the PEFT directory as given (/v1/models' root)
    base_model_name: str | None = None  # /v1/models' parent; None: the first served model name


def parse_lora_module(text: str) -> LoRAModulePath:
    """One ``--lora-modules`` value (argparse's ``type``)."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r} is not valid JSON: {exc}") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r} needs string fields name and path")
        unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
        if unknown:
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: unknown fields {unknown}")
        base = spec.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: base_model_name must be a string")
        name, path = spec["name"], spec["path"]
    else:
        name, sep, path = text.partition("=")
        base = None
        if not sep:
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r} must be name=path or a JSON object")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: the name and the path must not be empty")
    return LoRAModulePath(name, path, base)


def check_lora_modules(modules: list[LoRAModulePath], served_model_names: list[str]) -> None:
    """ValueError where two adapters share a name, or one takes a served model's name."""
    names = [m.name for m in modules]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--lora-modules names {repeated} more than once")
    taken = sorted(set(names) & set(served_model_names))
    if taken:
        raise ValueError(f"--lora-modules {taken} is already a served model name (--served-model-name)")


def lora_name_of(modules: Mapping[str, LoRAModulePath], model: str | None) -> str:
    """The adapter a request's ``model`` names ("" for the base model), once it passed check_model."""
    return model if model is not None and model in modules else ""


def lora_model_card(module: LoRAModulePath, base_model_name: str) -> p.ModelCard:
    """An adapter in /v1/models as vLLM lists it: its path as ``root``, its base model as ``parent``."""
    from kvscale.server.entrypoints import protocol as p  # pydantic: not at `kvscale serve --help`

    return p.ModelCard(id=module.name, root=module.path, parent=module.base_model_name or base_model_name)
