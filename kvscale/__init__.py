"""kvscale: a Kubernetes-native LLM serving platform.

``from kvscale import LLM, SamplingParams`` is the offline API; the heavy engine modules are
imported on first use so that the CLI and the operator start without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from kvscale.server.entrypoints.llm import LLM
    from kvscale.server.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvscale.server.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvscale.server.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvscale' has no attribute {name!r}")
