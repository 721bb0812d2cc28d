"""LoRA adapters from an InferenceService's `spec.adapters` (docs/operator.md, "LoRA adapters").

Each adapter becomes a `--lora-modules NAME=PATH` of every server, with `--enable-lora` and the
engine.maxLoras / maxLoraRank / maxCpuLoras the spec sets, as vLLM's own Kubernetes manifests
pass them. Its files come the way the model's do (operator/children/model_files.py): a
pvc://CLAIM/PATH adapter from the claim mounted read-only (the model's own mount when it is the
model's claim), an hf://ORG/NAME adapter fetched by an init container into the model volume.

What the operator can tell without the files is checked here, and a spec failing it gets
nothing applied (Synced=False, as for tensor parallel): flags in engine.extraArgs that would
override the spec's (argparse keeps the last value, and a second --lora-modules list replaces
the first), an adapter named like the served model, and what the engine serves no adapter with
(docs/server.md, "LoRA adapters": several tensor-parallel ranks, --quantization).
"""

from __future__ import annotations

from kvscale.operator.children.model_files import (
    MODEL_VOLUME_PATH,
    ModelFiles,
    hf_download,
    hf_fetch_container,
)
from kvscale.operator.conditions import SYNCED, Condition
from kvscale.operator.spec import InferenceServiceSpec, LoraAdapter
from kvscale.operator.tensor_parallel import tensor_parallel_size

ENABLE_FLAG = "--enable-lora"
MODULES_FLAG = "--lora-modules"
# In engine.extraArgs (or a platform default): the servers load and unload adapters at run time,
# and the router is given the same flag (operator/children/router.py).
RUNTIME_UPDATES_FLAG = "--allow-runtime-lora-updating"
LORA_ADAPTERS_CONFLICT = "LoraAdaptersConflict"
LORA_ADAPTERS_UNSUPPORTED = "LoraAdaptersUnsupported"
# Where an hf:// adapter is fetched to: one directory per adapter name (unique in the spec), apart
# from the model's /models/hf/ORG/NAME.
ADAPTERS_PATH = f"{MODEL_VOLUME_PATH}/adapters"


def engine_flags(spec: InferenceServiceSpec) -> list[tuple[str, int]]:
    """The engine.* LoRA settings the spec gives, as (flag, value)."""
    engine = spec.engine
    given = (("--max-loras", engine.max_loras), ("--max-lora-rank", engine.max_lora_rank),
             ("--max-cpu-loras", engine.max_cpu_loras))
    return [(flag, value) for flag, value in given if value is not None]


def adapter_path(adapter: LoraAdapter) -> str:
    """The adapter's PEFT directory inside a server pod."""
    if adapter.scheme == "pvc":
        claim, path = adapter.location.split("/", 1)
        return f"{MODEL_VOLUME_PATH}/pvc/{claim}/{path.strip('/')}"
    return f"{ADAPTERS_PATH}/{adapter.name}"


def lora_args(spec: InferenceServiceSpec) -> list[str]:
    """`kvscale serve` flags for spec.adapters; none without adapters. --lora-modules takes every
    value up to the next flag, so the caller puts another of its own flags after these."""
    if not spec.adapters:
        return []
    args = [ENABLE_FLAG]
    for flag, value in engine_flags(spec):
        args += [flag, str(value)]
    return [*args, MODULES_FLAG, *(f"{a.name}={adapter_path(a)}" for a in spec.adapters)]


def spec_flags(spec: InferenceServiceSpec) -> frozenset[str]:
    """The LoRA flags the spec sets itself: a platform default for one of them is dropped."""
    return frozenset(arg for arg in lora_args(spec) if arg.startswith("--"))


def adapter_files(spec: InferenceServiceSpec, files: ModelFiles) -> ModelFiles:
    """``files`` (the server's model) with the adapters' claims mounted and fetches added."""
    volumes, mounts, inits = list(files.volumes), list(files.mounts), list(files.init_containers)
    mounted = {spec.model.location.split("/", 1)[0]} if spec.model.scheme == "pvc" else set()
    for adapter in spec.adapters:
        if adapter.scheme == "pvc":
            claim = adapter.location.split("/", 1)[0]
            if claim in mounted:
                continue
            name = f"adapter-pvc-{len(volumes) - len(files.volumes)}"
            mounted.add(claim)
            volumes.append({"name": name,
                            "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
            mounts.append({"name": name, "mountPath": f"{MODEL_VOLUME_PATH}/pvc/{claim}",
                           "readOnly": True})
        else:
            fetch = f"fetch-adapter-{len(inits) - len(files.init_containers)}"
            inits.append(hf_fetch_container(fetch, spec.image,
                                            hf_download(adapter.location, adapter_path(adapter))))
    return ModelFiles(files.path, volumes, mounts, inits)


def refusal(spec: InferenceServiceSpec) -> Condition | None:
    """Synced=False with why, for adapters the servers would not serve as the spec says; None
    when they would (or the operator cannot tell without the files). ``spec`` carries the
    platform's defaults in engine.extraArgs, as its servers run."""
    if not spec.adapters:
        return None
    engine = spec.engine
    if engine.sets(MODULES_FLAG):
        return _conflict(f"engine.extraArgs set {MODULES_FLAG}, which would replace the list "
                         "spec.adapters renders (a second --lora-modules wins): name every "
                         "adapter in spec.adapters")
    for flag, value in engine_flags(spec):
        if engine.sets(flag):
            return _conflict(f"engine.extraArgs set {flag}, which would override the spec's "
                             f"{value}: set it in one place")
    taken = [a.name for a in spec.adapters if a.name == spec.model.served_name]
    if taken:
        return _conflict(f"adapter {taken[0]!r} has the served model's name (model.servedName): "
                         "a request's `model` would name both")
    size = tensor_parallel_size(spec)
    if size > 1:
        return _unsupported(f"{size} tensor-parallel ranks per replica")
    if engine.sets("--quantization") or any(a.startswith("-q") for a in engine.extra_args):
        return _unsupported("--quantization")
    return None


def _conflict(why: str) -> Condition:
    return Condition(SYNCED, False, LORA_ADAPTERS_CONFLICT, f"{why}; nothing is applied")


def _unsupported(what: str) -> Condition:
    return Condition(SYNCED, False, LORA_ADAPTERS_UNSUPPORTED,
                     f"spec.adapters cannot be served with {what}: the engine serves LoRA "
                     "adapters without it only (docs/server.md, \"LoRA adapters\"); nothing is "
                     "applied")
