"""The router of an InferenceService with spec.adapters knows their names (`--lora-adapter-names`):
at zero replicas it holds a request naming one and wakes the servers; and where the servers load
adapters at run time, the router is given the same flag (docs/operator.md, "LoRA adapters")."""

from __future__ import annotations

from kvscale.cli import build_parser
from kvscale.operator.children.router import router_args, service_router
from kvscale.operator.children.servers import (
    server_args,
    server_default_flags,
    with_server_defaults,
)
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


def test_servers_that_load_adapters_at_run_time_get_a_router_that_passes_the_loads_on() -> None:
    model = {"uri": "pvc://weights/base", "servedName": "base"}
    runtime = parse_spec({"model": model, "engine": {"extraArgs": ["--enable-lora", "--allow-runtime-lora-updating"]}})
    args = router_args(service_router("svc", "ns", runtime, "img"))
    assert build_parser("router").parse_args(args).allow_runtime_lora_updating
    # As a platform default for every server too (folded into the spec the router is built from).
    defaults = server_default_flags(["--enable-lora", "--allow-runtime-lora-updating"])
    spec = with_server_defaults(parse_spec({"model": model}), defaults)
    assert "--allow-runtime-lora-updating" in server_args(spec, None)
    assert build_parser("router").parse_args(router_args(service_router("svc", "ns", spec, "img"))).allow_runtime_lora_updating
    plain = parse_spec({"model": model, "engine": {"extraArgs": ["--enable-lora"]}})
    assert not build_parser("router").parse_args(router_args(service_router("svc", "ns", plain, "img"))).allow_runtime_lora_updating
    # With tenants any tenant's key would load paths onto every server: the router is not given it.
    tenants = parse_spec({"model": model, "engine": {"extraArgs": ["--enable-lora", "--allow-runtime-lora-updating"]},
                          "apiKeySecretRef": {"name": "servers-key"},
                          "router": {"tenants": [{"name": "a", "apiKeySecretRef": {"name": "a-key"}}]}})
    assert "--allow-runtime-lora-updating" not in router_args(service_router("svc", "ns", tenants, "img"))
