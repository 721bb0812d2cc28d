"""The `kvscale` command. Each subcommand's flags and body live with the part that owns it."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module that owns it, one-line help). Each module defines
# `add_arguments(parser)` and `run(args) -> int` and must import nothing heavy at import time.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("kvscale.server.entrypoints.cli_generate", "generate text from a prompt (a quick look)"),
    "serve": ("kvscale.server.entrypoints.cli_serve", "serve an OpenAI-compatible API"),
    "router": ("kvscale.router.cli_router", "route requests to replicas by KV-cache prefix"),
    "up": ("kvscale.router.cli_up", "run Redis, N replicas and the router on this machine"),
    "operator": ("kvscale.operator.cli_operator", "run the Kubernetes operator"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with flags loaded only for `command` so one subcommand never pays for another."""
    from kvscale import __version__

    parser = argparse.ArgumentParser(prog="kvscale", description="kvscale LLM serving")
    parser.add_argument("--version", action="version", version=f"kvscale {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command if command in SUBCOMMANDS else None).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        # Ctrl-C: uvicorn shuts down cleanly, then raises the signal again for its caller. The
        # shell's code for an interrupt, not a traceback a user would read as a crash.
        return 130
