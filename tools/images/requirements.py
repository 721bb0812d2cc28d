"""Print the pinned requirements of pyproject.toml's optional groups, one a line.

The Dockerfiles install these before copying any source, so a source change never re-downloads
torch: `python requirements.py engine > req.txt && pip install -r req.txt`. Groups that name
`kvscale[...]` are followed to their members.
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


def main(argv: list[str]) -> int:
    pyproject = Path(argv[2]) if len(argv) > 2 else Path(__file__).with_name("pyproject.toml")
    groups = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    print("\n".join(requirements(groups, argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
