"""Objects built in Python, written as a Helm template: where a chart value enters, the object
holds a sentinel, and after the object is dumped as YAML each sentinel becomes its Helm text.

Two kinds of sentinel:
- a scalar (`value`): a string standing for `{{ expression }}` in its place;
- a block (`include`, `to_yaml`, `items_of`, `with_key`, `branches`): a one-key mapping, placed as a key of a
  mapping or as an item of a list, whose whole line becomes Helm lines at that line's indentation
  (control lines trim their own line with `{{-`, as charts do).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import yaml

_TOKEN = re.compile(r"'?@@helm-(\d+)@@'?")


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True  # a list shared by two rules is written twice, not as an anchor


def dump(obj: Any) -> str:
    """Block-style YAML in the order the builders wrote the keys."""
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     width=1_000_000)


class HelmTemplate:
    def __init__(self) -> None:
        self._scalars: dict[str, str] = {}
        self._blocks: dict[str, Callable[[str], list[str]]] = {}

    def _token(self) -> str:
        return f"@@helm-{len(self._scalars) + len(self._blocks)}@@"

    def value(self, expression: str) -> str:
        """A scalar: `{{ expression }}`."""
        token = self._token()
        self._scalars[token] = f"{{{{ {expression} }}}}"
        return token

    def _block(self, render: Callable[[str], list[str]]) -> dict[str, str]:
        token = self._token()
        self._blocks[token] = render
        return {token: ""}

    def include(self, template: str) -> dict[str, str]:
        """The lines of a named template (`define`) of the chart."""
        return self._block(lambda pad: [f'{pad}{{{{- include "{template}" . | nindent {len(pad)} }}}}'])

    def to_yaml(self, expression: str) -> dict[str, str]:
        """A value of the chart written as YAML where the block stands."""
        return self._block(lambda pad: [f"{pad}{{{{- toYaml {expression} | nindent {len(pad)} }}}}"])

    def items_of(self, expression: str) -> dict[str, str]:
        """The entries of a mapping (or items of a list) value, when it is not empty."""
        return self._block(lambda pad: [
            f"{pad}{{{{- with {expression} }}}}",
            f"{pad}{{{{- toYaml . | nindent {len(pad)} }}}}",
            f"{pad}{{{{- end }}}}",
        ])

    def with_key(self, key: str, expression: str) -> dict[str, str]:
        """`key: <the value as YAML>` when the value is not empty, else nothing."""
        return self._block(lambda pad: [
            f"{pad}{{{{- with {expression} }}}}",
            f"{pad}{key}:",
            f"{pad}  {{{{- toYaml . | nindent {len(pad) + 2} }}}}",
            f"{pad}{{{{- end }}}}",
        ])

    def branches(self, *cases: tuple[str | None, Any]) -> dict[str, str]:
        """The YAML of the first case whose condition holds (None: otherwise); items of a list
        when the block is a list item, keys of a mapping when it is a key."""
        def render(pad: str) -> list[str]:
            lines = []
            for index, (condition, obj) in enumerate(cases):
                keyword = "if" if index == 0 else ("else if" if condition is not None else "else")
                lines.append(f"{pad}{{{{- {keyword}{'' if condition is None else ' ' + condition} }}}}")
                lines += [f"{pad}{line}" for line in dump(obj).splitlines()]
            return lines + [f"{pad}{{{{- end }}}}"]
        return self._block(render)

    def render(self, obj: Any) -> str:
        """`obj` as YAML with every sentinel replaced by its Helm text."""
        lines: list[str] = []
        for line in dump(obj).splitlines():
            token = next((t for t in self._blocks if t in line), None)
            if token is None:
                lines.append(line)
                continue
            if line.strip() not in (f"'{token}': ''", f"- '{token}': ''"):
                raise ValueError(f"{token} in {line.strip()!r}: a block must be a whole line "
                                 "(a key of a mapping or an item of a list)")
            pad = " " * (len(line) - len(line.lstrip(" ")))
            lines += self._blocks[token](pad)
        return _TOKEN.sub(self._scalar, "\n".join(lines) + "\n")

    def _scalar(self, match: re.Match[str]) -> str:
        token = f"@@helm-{match.group(1)}@@"
        if token not in self._scalars:
            raise ValueError(f"{token} stands where only a scalar can: a block must be a whole line")
        return self._scalars[token]
