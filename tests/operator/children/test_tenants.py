"""spec.router.tenants: the router's tenants file in a ConfigMap naming variables, the keys set in
the router pod from the tenants' Secrets (docs/operator.md, "Tenants"). Pure builders; the file
and the command line read by the real router's loader and argument parser."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import yaml

from kvscale.cli import build_parser
from kvscale.operator.children import owned
from kvscale.operator.children.router import build_router_deployment, service_router
from kvscale.operator.children.tenants import FILE_NAME, MOUNT_PATH
from kvscale.operator.spec import SecretKeyRef, TenantSpec, parse_spec
from kvscale.router import tenants as router_tenants
from kvscale.router.cli_router import config_from_args

CRD_PATH = Path(__file__).resolve().parents[3] / "crds" / "inferenceservice.yaml"
KEYED = {"model": {"uri": "bundled://smollm2-135m-instruct"},
         "apiKeySecretRef": {"name": "servers-key"}}
TENANTS = [
    {"name": "team-a", "apiKeySecretRef": {"name": "team-a-key", "key": "token"},
     "requestsPerMinute": 600, "tokensPerMinute": 200000, "weight": 2, "priority": -1},
    {"name": "batch.jobs_1", "apiKeySecretRef": {"name": "batch-key"}},
]
# What the Secrets hold: the kubelet's to read, never the operator's.
SECRETS = {("team-a-key", "token"): "sk-team-a", ("batch-key", "api-key"): "sk-batch",
           ("servers-key", "api-key"): "sk-servers", ("chat-redis", "password"): "redis-pw"}


def with_tenants(tenants: list[dict] = TENANTS) -> dict:
    return {**KEYED, "router": {"tenants": tenants}}


def router_pod(spec: dict) -> dict:
    deployment = build_router_deployment(service_router("chat", "team", parse_spec(spec), "img"))
    return deployment["spec"]["template"]["spec"]


def kubelet_env(container: dict) -> dict[str, str]:
    """The container's environment as the kubelet sets it from the Secrets."""
    env = {}
    for var in container["env"]:
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            env[var["name"]] = SECRETS[(ref["name"], ref["key"])]
        elif "value" in var:
            env[var["name"]] = var["value"]
    return env


def test_the_tenants_file_names_variables_and_the_pod_sets_them_from_the_secrets():
    children = owned.build_children("chat", "team", parse_spec(with_tenants()))
    (config_map,) = [c for c in children if c["kind"] == "ConfigMap"]
    assert config_map["metadata"]["name"] == "chat-router-tenants"
    text = config_map["data"][FILE_NAME]
    # No key in any child: the operator never had one.
    assert not any(value in yaml.safe_dump(children) for value in SECRETS.values())
    assert not [c for c in children if c["kind"] == "Secret"]
    assert yaml.safe_load(text) == [
        {"name": "team-a", "api_key_env": "KVSCALE_TENANT_KEY_0", "requests_per_minute": 600,
         "tokens_per_minute": 200000, "weight": 2.0, "priority": -1},
        {"name": "batch.jobs_1", "api_key_env": "KVSCALE_TENANT_KEY_1", "weight": 1.0, "priority": 0}]
    container = router_pod(with_tenants())["containers"][0]
    table = router_tenants.parse_tenants(text, environ=kubelet_env(container))
    assert [(t.name, t.key_sha256) for t in table.tenants] == [
        ("team-a", hashlib.sha256(b"sk-team-a").digest()),
        ("batch.jobs_1", hashlib.sha256(b"sk-batch").digest())]
    assert table.tenants[0].requests_per_minute == 600 and table.tenants[0].weight == 2.0


def test_the_router_reads_the_mounted_file_with_the_real_cli(tmp_path, monkeypatch):
    pod = router_pod(with_tenants())
    container = pod["containers"][0]
    env = kubelet_env(container)
    # The clients' key is the tenant's: the service's key reaches the servers only, as the
    # replicas' key (--api-key and --tenants are exclusive).
    assert "KVSCALE_API_KEY" not in env and env["KVSCALE_REPLICA_API_KEY"] == "sk-servers"
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == MOUNT_PATH]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"] == {"name": "chat-router-tenants"} and mount["readOnly"]
    # The kubelet's mount: the ConfigMap's data as files under the mount path.
    config_map = next(c for c in owned.build_children("chat", "team", parse_spec(with_tenants()))
                      if c["kind"] == "ConfigMap")
    (tmp_path / FILE_NAME).write_text(config_map["data"][FILE_NAME])
    for name, value in {**env, "KVSCALE_REDIS_URL": "redis://redis:6379"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("KVSCALE_API_KEY", raising=False)
    args = [re.sub(r"\$\(POD_NAMESPACE\)", "team", a).replace(MOUNT_PATH, str(tmp_path))
            for a in container["args"]]
    assert f"{tmp_path}/{FILE_NAME}" in args
    config = config_from_args(build_parser("router").parse_args(args))
    assert config.tenants is not None and config.tenants.table.names == ["team-a", "batch.jobs_1"]
    assert config.replica_api_key == "sk-servers"


def test_without_tenants_the_router_keeps_the_service_key_and_no_config_map():
    pod = router_pod(KEYED)
    env = kubelet_env(pod["containers"][0])
    assert env["KVSCALE_API_KEY"] == env["KVSCALE_REPLICA_API_KEY"] == "sk-servers"
    assert "--tenants" not in pod["containers"][0]["args"]
    assert not any(v["name"] == "tenants" for v in pod["volumes"])
    spec = parse_spec(KEYED)
    assert ("v1", "configmaps", "chat-router-tenants") in owned.unwanted_children("chat", "team", spec)
    assert ("v1", "configmaps", "chat-router-tenants") not in owned.unwanted_children(
        "chat", "team", parse_spec(with_tenants()))
    assert not [c for c in owned.build_children("chat", "team", spec) if c["kind"] == "ConfigMap"]


def test_tenants_need_the_servers_key_and_the_router():
    assert parse_spec(with_tenants()).router.tenants == (
        TenantSpec("team-a", SecretKeyRef("team-a-key", "token"), 600, 200000, 2.0, -1),
        TenantSpec("batch.jobs_1", SecretKeyRef("batch-key", "api-key")))
    with pytest.raises(ValueError, match="apiKeySecretRef"):
        parse_spec({"model": KEYED["model"], "router": {"tenants": TENANTS}})
    with pytest.raises(ValueError, match="needs the router"):
        parse_spec({**KEYED, "router": {"enabled": False, "tenants": TENANTS}})


def test_the_crd_bounds_a_tenant_as_the_router_does():
    crd = yaml.safe_load(CRD_PATH.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    tenants = schema["properties"]["spec"]["properties"]["router"]["properties"]["tenants"]
    assert tenants["maxItems"] <= router_tenants.MAX_TENANTS
    assert tenants["x-kubernetes-list-type"] == "map" and tenants["x-kubernetes-list-map-keys"] == ["name"]
    item = tenants["items"]["properties"]
    assert item["name"]["pattern"] == router_tenants._NAME.pattern
    assert item["apiKeySecretRef"]["properties"]["key"]["default"] == "api-key"
    assert (item["weight"]["minimum"], item["weight"]["maximum"]) == (0, 1_000_000)
    assert item["weight"]["exclusiveMinimum"] and item["weight"]["exclusiveMaximum"]
    assert (item["priority"]["minimum"], item["priority"]["maximum"]) == (-1_000_000, 1_000_000)
    assert item["weight"]["default"] == TenantSpec("x", None).weight  # type: ignore[arg-type]
    assert item["priority"]["default"] == TenantSpec("x", None).priority  # type: ignore[arg-type]
    # Every field of the CRD's is one the operator reads (a field it ignored would be a lie).
    assert set(item) == {"name", "apiKeySecretRef", "requestsPerMinute", "tokensPerMinute",
                         "weight", "priority"}
    rules = [r["rule"] for r in schema["x-kubernetes-validations"]]
    assert any("tenants" in r and "apiKeySecretRef" in r for r in rules)
