"""The layers import-linter enforces (pyproject.toml) cover every shipped module.

`make test` runs `lint-imports`; these tests keep its contracts from passing by not looking: a
module grimp cannot see (a namespace package not named as a root) or a shared module missing from
the shared layer's contract would escape them.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import grimp

REPO_ROOT = Path(__file__).resolve().parents[2]
PARTS = ("server", "router", "operator", "kernels")
ENTRY_POINTS = {"__init__", "__main__", "cli"}


def _linter_config() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def _shipped_modules() -> set[str]:
    modules = set()
    for path in (REPO_ROOT / "kvscale").glob("*.py"):
        modules.add("kvscale" if path.stem == "__init__" else f"kvscale.{path.stem}")
    for part in PARTS:
        for path in (REPO_ROOT / part).rglob("*.py"):
            dotted = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
            modules.add(f"kvscale.{dotted}".removesuffix(".__init__"))
    return modules


def test_the_parts_are_linked_into_the_package():
    for part in PARTS:
        link = REPO_ROOT / "kvscale" / part
        assert link.is_symlink() and link.resolve() == (REPO_ROOT / part).resolve(), part
    # A regular package named `operator` at the checkout's root would shadow the standard library.
    assert not (REPO_ROOT / "operator" / "__init__.py").exists()


def test_the_wheel_lists_every_package():
    """setuptools' explicit package list (a namespace package cannot be found by `find`): a folder
    of modules missing from it would be missing from the images, while the editable install hides it."""
    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"kvscale"} | {
        "kvscale." + ".".join(path.parent.relative_to(REPO_ROOT).parts)
        for part in PARTS for path in (REPO_ROOT / part).rglob("*.py")
    }
    assert listed == folders


def test_the_import_graph_holds_every_shipped_module():
    graph = grimp.build_graph(*_linter_config()["root_packages"])
    assert _shipped_modules() - graph.modules == set()


def test_the_shared_layer_contract_lists_every_shared_module():
    shared = next(c for c in _linter_config()["contracts"] if c["name"] == "The shared layer imports no part")
    on_disk = {f"kvscale.{p.stem}" for p in (REPO_ROOT / "kvscale").glob("*.py") if p.stem not in ENTRY_POINTS}
    assert set(shared["source_modules"]) == on_disk


def test_the_architecture_page_names_every_shipped_module():
    page = (REPO_ROOT / "docs" / "architecture.md").read_text()
    files = [p for p in (REPO_ROOT / "kvscale").glob("*.py")]
    for part in PARTS:
        files += [p for p in (REPO_ROOT / part).rglob("*.py") if p.name != "__init__.py"]
    missing = sorted(str(p.relative_to(REPO_ROOT)) for p in files
                     if f"`{p.relative_to(REPO_ROOT)}`" not in page and p.name != "__main__.py")
    assert missing == []


def test_every_engine_module_sits_in_a_layer_or_is_shared():
    """server/'s top level holds only what every layer shares (the shared modules' contract lists
    them); everything else lives in a subpackage the layers contract names."""
    contracts = _linter_config()["contracts"]
    layers = next(c for c in contracts if c.get("containers") == ["kvscale.server"])
    named = {name.strip() for layer in layers["layers"] for name in layer.split("|")}
    shared = next(c for c in contracts if c["name"] == "The engine's shared modules import no layer")
    server = REPO_ROOT / "server"
    top_level = {f"kvscale.server.{p.stem}" for p in server.glob("*.py") if p.stem != "__init__"}
    subpackages = {p.parent.name for p in server.glob("*/__init__.py")}
    assert top_level == set(shared["source_modules"])
    assert subpackages == named
    assert set(shared["forbidden_modules"]) == {f"kvscale.server.{name}" for name in named}
