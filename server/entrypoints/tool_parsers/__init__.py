"""Tool-call formats: how a model family writes calls, read back out of its answer.

One module per format (``--tool-call-parser``): hermes.py (``<tool_call>`` tags around
``{"name", "arguments"}``), llama3_json.py (bare ``{"name", "parameters"}``). Each gives the
grammar that forces calls in its format (named and ``required`` tool choice), the grammar that
lets text through until a call opens and then holds it to the declared tools (``auto``), and the
parser that finds them in text, whole or partial (streaming). How tools and past calls are shown to the model
is prompt rendering, in kvscale/tokenization.py, shared with the router.
"""

from kvscale.server.entrypoints.tool_parsers.base import ParsedCall, ToolCallFormat
from kvscale.server.entrypoints.tool_parsers.hermes import HermesFormat
from kvscale.server.entrypoints.tool_parsers.llama3_json import Llama3JsonFormat

FORMATS: dict[str, type[ToolCallFormat]] = {"hermes": HermesFormat, "llama3_json": Llama3JsonFormat}


def tool_call_format(name: str | None) -> ToolCallFormat:
    """The format named by ``--tool-call-parser`` (Hermes when none is set)."""
    return FORMATS[name or "hermes"]()


__all__ = ["FORMATS", "ParsedCall", "ToolCallFormat", "tool_call_format"]
