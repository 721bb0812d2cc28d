"""kvscale: a Kubernetes-native LLM serving platform.

``from kvscale import LLM, SamplingParams`` is the offline API; the heavy engine modules are
imported on first use so that the CLI and the operator start without loading torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

# `operator/` has no __init__.py on purpose: a regular package named `operator` at the root of a
# checkout would shadow the standard library's module whenever that root is on sys.path (any
# `python -m ...` run there). Installed from a wheel, the folder sits inside kvscale/ and imports
# as a namespace package; in an editable install of a checkout, the checkout's root joins this
# package's search path so that `kvscale.operator` resolves to `operator/` there.
_checkout_root = Path(__file__).resolve().parent.parent
if (_checkout_root / "pyproject.toml").is_file() and (_checkout_root / "operator").is_dir():
    __path__.append(str(_checkout_root))

if TYPE_CHECKING:
    from kvscale.server.llm import LLM
    from kvscale.server.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvscale.server.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvscale.server.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvscale' has no attribute {name!r}")
