"""No shipped module over 400 lines without a sentence at its top saying why (docs/architecture.md,
"Every module"): a module that long usually holds two concepts."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_FOLDERS = ("kvscale", "server", "router", "operator", "kernels", "bench", "tools")
MAX_LINES = 400


def shipped_modules() -> list[Path]:
    modules = []
    for folder in SHIPPED_FOLDERS:
        root = REPO_ROOT / folder
        # kvscale/ links the parts in (server, router, operator, kernels): its own files only.
        paths = root.glob("*.py") if folder == "kvscale" else root.rglob("*.py")
        modules += [path for path in paths if "node_modules" not in path.parts]
    return sorted(modules)


def says_why_it_is_long(source: str) -> bool:
    docstring = ast.get_docstring(ast.parse(source)) or ""
    return f"over {MAX_LINES} lines" in " ".join(docstring.split()).lower()


def test_the_rule_sees_a_long_module_and_its_reason():
    long_body = "x = 1\n" * (MAX_LINES + 1)
    assert not says_why_it_is_long('"""A module."""\n' + long_body)
    assert says_why_it_is_long('"""A registry. Over 400\nlines: one table by design."""\n' + long_body)


def test_no_shipped_module_is_over_the_limit_without_saying_why():
    assert len(shipped_modules()) > 100  # the folders above are where the code is
    too_long = {
        str(path.relative_to(REPO_ROOT)): lines
        for path in shipped_modules()
        if (lines := len((text := path.read_text()).splitlines())) > MAX_LINES and not says_why_it_is_long(text)
    }
    assert too_long == {}
