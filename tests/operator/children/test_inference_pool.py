"""spec.router.inferencePool: the pool and picker Service builders, the routers' flag and port,
the spec's refusals, and the CRD's defaults equal to the spec's (pure; the real apiserver runs
tests/operator/test_inference_pool.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvscale.cli import build_parser
from kvscale.operator.children import owned
from kvscale.operator.children.inference_pool import (
    build_inference_pool,
    build_picker_service,
    pool_wanted,
)
from kvscale.operator.children.servers import build_headless_service
from kvscale.operator.spec import InferencePoolSpec, parse_spec
from kvscale.router.cli_router import config_from_args

BUNDLED = {"model": {"uri": "bundled://smollm2-135m-instruct"}}
CRD_PATH = Path(__file__).resolve().parents[3] / "crds" / "inferenceservice.yaml"


def pool_spec(**pool):
    return parse_spec({**BUNDLED, "router": {"inferencePool": {"enabled": True, **pool}}})


def router_container(children: list[dict]) -> dict:
    router = next(c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "chat-router")
    return router["spec"]["template"]["spec"]["containers"][0]


def test_the_pool_selects_the_servers_and_names_the_routers_as_picker():
    spec = pool_spec()
    pool = build_inference_pool("chat", "team", spec)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert pool["metadata"]["name"] == "chat" and pool["metadata"]["namespace"] == "team"
    # The same pods the servers' Services select: never the routers.
    assert pool["spec"]["selector"]["matchLabels"] == build_headless_service("chat", "team")["spec"]["selector"]
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service", "name": "chat-router", "port": {"number": 9002}, "failureMode": "FailClose"}
    service = build_picker_service("chat", "team", spec)
    assert service["metadata"]["name"] == "chat-router"
    assert service["spec"]["selector"] == {"serving.kvscale.io/router": "chat"}
    assert service["spec"]["ports"] == [{"name": "grpc-ext-proc", "port": 9002, "targetPort": "grpc-ext-proc",
                                         "protocol": "TCP", "appProtocol": "http2"}]


def test_enabled_the_routers_serve_the_picker_and_their_service_exposes_it():
    children = owned.build_children("chat", "team", pool_spec(extProcPort=9100, failureMode="FailOpen"))
    assert ("Service", "chat-router") in [(c["kind"], c["metadata"]["name"]) for c in children]
    container = router_container(children)
    assert {"name": "grpc-ext-proc", "containerPort": 9100, "protocol": "TCP"} in container["ports"]
    # The real router parser accepts what the operator writes, and refuses nothing in it.
    args = build_parser("router").parse_args(
        [a.replace("$(POD_NAMESPACE)", "team") for a in container["args"]])
    assert args.ext_proc_port == 9100
    config_from_args(args)
    assert ("v1", "services", "chat-router") not in owned.unwanted_children("chat", "team", pool_spec())


def test_with_a_key_and_tenants_the_picker_checks_them_as_the_http_port_does():
    """The picker answers 401 and 429 itself and names the tenant to the servers behind their key
    (docs/gateway.md, "Keys and tenants"): the routers get the tenants file and the servers' key
    beside --ext-proc-port, and the router's parser accepts the combination."""
    tenant = {"name": "team-a", "apiKeySecretRef": {"name": "team-a-key"}, "requestsPerMinute": 60}
    spec = parse_spec({**BUNDLED, "apiKeySecretRef": {"name": "servers-key"},
                       "router": {"tenants": [tenant], "inferencePool": {"enabled": True}}})
    container = router_container(owned.build_children("chat", "team", spec))
    assert "--ext-proc-port" in container["args"] and "--tenants" in container["args"]
    env = {e["name"]: e for e in container["env"]}
    assert env["KVSCALE_REPLICA_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "servers-key"
    args = build_parser("router").parse_args(
        [a.replace("$(POD_NAMESPACE)", "team") for a in container["args"]])
    assert args.ext_proc_port == 9002 and args.tenants


def test_disabled_nothing_of_it_is_made_and_its_service_is_unwanted():
    spec = parse_spec(BUNDLED)
    assert not pool_wanted(spec)
    children = owned.build_children("chat", "team", spec)
    assert "--ext-proc-port" not in router_container(children)["args"]
    assert [p["name"] for p in router_container(children)["ports"]] == ["http"]
    assert ("Service", "chat-router") not in [(c["kind"], c["metadata"]["name"]) for c in children]
    assert ("v1", "services", "chat-router") in owned.unwanted_children("chat", "team", spec)


@pytest.mark.parametrize(("spec", "words"), [
    ({"router": {"enabled": False, "inferencePool": {"enabled": True}}}, "needs the router"),
    ({"router": {"inferencePool": {"enabled": True, "extProcPort": 8080}}}, "extProcPort"),
    ({"router": {"inferencePool": {"enabled": True, "failureMode": "Maybe"}}}, "failureMode"),
])
def test_what_the_spec_refuses(spec, words):
    with pytest.raises(ValueError, match=words):
        parse_spec({**BUNDLED, **spec})


def test_the_crd_defaults_are_the_spec_defaults():
    crd = yaml.safe_load(CRD_PATH.read_text())
    router = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["router"]
    schema = router["properties"]["inferencePool"]["properties"]
    defaults = InferencePoolSpec()
    assert schema["enabled"]["default"] is defaults.enabled
    assert schema["extProcPort"]["default"] == defaults.ext_proc_port
    assert schema["failureMode"]["default"] == defaults.failure_mode
    assert set(schema["failureMode"]["enum"]) == {"FailOpen", "FailClose"}
