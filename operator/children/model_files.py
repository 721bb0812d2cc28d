"""Where a pod finds an InferenceService's model: its path inside the pod, the volumes holding it,
and for hf:// the init container fetching it.

Servers need the whole model; routers only its tokenizer, from the same source and at the same
path, so both tokenize alike (``for_router``). The bundled model needs nothing: the images carry
it (the engine image converted, the control-plane image its tokenizer alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvscale.operator.children.pod_parts import container_security_context
from kvscale.operator.spec import InferenceServiceSpec

MODEL_VOLUME_PATH = "/models"
# What transformers reads to build a tokenizer and its chat template, and nothing of the
# weights: configs and tokenizer.json, a Jinja chat template, SentencePiece or tiktoken files,
# BPE merges.
TOKENIZER_FILES = ("*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken")


@dataclass(frozen=True)
class ModelFiles:
    path: str | None  # --model inside the pod; None: the bundled model
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def model_files(spec: InferenceServiceSpec, image: str, for_router: bool = False) -> ModelFiles:
    """The model of ``spec`` in a pod whose containers run ``image``.

    A server always gets the writable model cache (its HF_HOME lives there); a router only when
    an hf:// tokenizer is fetched into it.
    """
    model = spec.model
    files = ModelFiles(None)
    if not for_router or model.scheme == "hf":
        files.volumes.append({"name": "model-cache", "emptyDir": {}})
        files.mounts.append({"name": "model-cache", "mountPath": MODEL_VOLUME_PATH})
    if model.scheme == "pvc":
        claim, path = model.location.split("/", 1)
        files.volumes.append({"name": "model-pvc",
                              "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        files.mounts.append({"name": "model-pvc", "mountPath": f"{MODEL_VOLUME_PATH}/pvc/{claim}",
                             "readOnly": True})
        return replace(files, path=f"{MODEL_VOLUME_PATH}/pvc/{claim}/{path.strip('/')}")
    if model.scheme == "bundled":
        return files
    # hf://ORG/NAME: the server never downloads, so an init container fetches into the volume.
    target = f"{MODEL_VOLUME_PATH}/hf/{model.location}"
    command = hf_download(model.location, target)
    if for_router:
        for pattern in TOKENIZER_FILES:
            command += ["--include", pattern]
    files.init_containers.append(
        hf_fetch_container("fetch-tokenizer" if for_router else "fetch-model", image, command))
    return replace(files, path=target)


def hf_download(repo: str, target: str) -> list[str]:
    return ["hf", "download", repo, "--local-dir", target]


def hf_fetch_container(name: str, image: str, command: list[str]) -> dict[str, Any]:
    """An init container running ``command`` (`hf download`) into the model volume."""
    return {
        "name": name,
        "image": image,
        "command": command,
        # The images keep servers and routers offline (HF_HUB_OFFLINE=1); this container is the
        # one that downloads, so it turns that off for itself.
        "env": [{"name": "HF_HOME", "value": f"{MODEL_VOLUME_PATH}/hf-home"},
                {"name": "HF_HUB_OFFLINE", "value": "0"}],
        "volumeMounts": [{"name": "model-cache", "mountPath": MODEL_VOLUME_PATH},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": container_security_context(),
    }
