"""The router of an InferenceService with spec.adapters knows their names (`--lora-adapter-names`):
at zero replicas it holds a request naming one and wakes the servers (docs/operator.md, "LoRA
adapters")."""

from __future__ import annotations

from kvscale.operator.children.router import router_args, service_router
from kvscale.operator.spec import parse_spec


def test_the_operator_gives_its_router_the_adapters_names() -> None:
    spec = parse_spec({"model": {"uri": "pvc://weights/base", "servedName": "base"},
                       "adapters": [{"name": "sql", "uri": "pvc://weights/sql"},
                                    {"name": "chat", "uri": "hf://org/chat"}]})
    args = router_args(service_router("svc", "ns", spec, "img"))
    at = args.index("--lora-adapter-names")
    assert args[at + 1:at + 3] == ["sql", "chat"] and args[at + 3].startswith("--")
    plain = parse_spec({"model": {"uri": "pvc://weights/base", "servedName": "base"}})
    assert "--lora-adapter-names" not in router_args(service_router("svc", "ns", plain, "img"))
