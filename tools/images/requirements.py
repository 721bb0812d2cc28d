"""Print the pinned requirements of pyproject.toml's optional groups, one a line.

The Dockerfiles install these before copying any source, so a source change never re-downloads
torch: `python requirements.py engine > req.txt && pip install -r req.txt`. Groups that name
`kvscale[...]` are followed to their members.

`--heavy` prints only the packages whose wheels weigh gigabytes (torch and triton: the CUDA
libraries come with them), `--light` all the others. The engine's Dockerfile installs them in two
layers, so a new or changed small pin reinstalls the small ones alone.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(groups: dict[str, list[str]], group: str) -> list[str]:
    if group not in groups:
        raise SystemExit(f"no optional-dependencies group {group!r} (have: {', '.join(groups)})")
    out: list[str] = []
    for requirement in groups[group]:
        name = requirement.split("[", 1)[0].strip()
        if name == "kvscale":
            for inner in requirement.split("[", 1)[1].rstrip("]").split(","):
                out += requirements(groups, inner.strip())
        else:
            out.append(requirement)
    return list(dict.fromkeys(out))


HEAVY = frozenset({"torch", "triton"})


def package_name(requirement: str) -> str:
    for separator in ("[", "=", "<", ">", "!", "~", ";", " "):
        requirement = requirement.split(separator, 1)[0]
    return requirement.strip().lower()


def main(argv: list[str]) -> int:
    part = next((a for a in argv[1:] if a in ("--heavy", "--light")), None)
    args = [a for a in argv[1:] if a != part]
    pyproject = Path(args[1]) if len(args) > 1 else Path(__file__).with_name("pyproject.toml")
    groups = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    chosen = requirements(groups, args[0])
    if part is not None:
        chosen = [r for r in chosen if (package_name(r) in HEAVY) == (part == "--heavy")]
    print("\n".join(chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
