"""tools/images/requirements.py: what each Dockerfile layer installs, from pyproject.toml's groups."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "images" / "requirements.py"


def printed(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, str(SCRIPT), *args, str(REPO / "pyproject.toml")],
                         capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


def test_the_engine_layers_split_its_pins_into_torch_and_triton_then_the_rest() -> None:
    every, heavy, light = printed("engine"), printed("engine", "--heavy"), printed("engine", "--light")
    engine = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["engine"]
    assert every == engine
    assert sorted(r.split("==")[0] for r in heavy) == ["torch", "triton"]
    assert sorted(heavy + light) == sorted(every) and not set(heavy) & set(light)


def test_groups_naming_kvscale_are_followed_to_their_members() -> None:
    control_plane = printed("control-plane")
    assert "kopf" in {r.split("==")[0] for r in control_plane} and "torch" not in " ".join(control_plane)
    assert len(control_plane) == len(set(control_plane))
