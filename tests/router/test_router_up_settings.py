"""`kvscale up`'s settings for its children: the adapters' names the router holds requests for,
and which key variables the router gets with and without --tenants."""

from __future__ import annotations

import pytest

from kvscale.router.cli_up import lora_module_name, router_keys


def test_an_adapters_name_in_either_spelling_of_lora_modules() -> None:
    assert lora_module_name("sql=/adapters/sql") == "sql"
    assert lora_module_name('{"name": "chat", "path": "/a/chat", "base_model_name": "m"}') == "chat"
    for bad in ("/adapters/sql", "=/adapters/sql", '{"path": "/a"}', "{not json", '["sql"]'):
        with pytest.raises(ValueError, match="name=path or a JSON object"):
            lora_module_name(bad)


def test_with_tenants_the_key_guards_the_replicas_only() -> None:
    assert router_keys(None, None) == {}
    assert router_keys("k", None) == {"KVSCALE_API_KEY": "k", "KVSCALE_REPLICA_API_KEY": "k"}
    # The router refuses $KVSCALE_API_KEY beside --tenants: one inherited is taken away.
    assert router_keys("k", "tenants.yaml") == {"KVSCALE_API_KEY": None, "KVSCALE_REPLICA_API_KEY": "k"}
    assert router_keys(None, "tenants.yaml") == {"KVSCALE_API_KEY": None, "KVSCALE_REPLICA_API_KEY": None}
