"""spec.adapters: the servers' LoRA flags and the adapters' files, built from the spec, read back
by `kvscale serve`'s own parser; the settings the servers would not honour refused before
anything is applied; and the CRD's schema holding the same bounds and sources."""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from operator_helpers import RefusedSpecKube

from kvscale.operator import lora_adapters
from kvscale.operator.children import servers
from kvscale.operator.children.servers import build_deployment
from kvscale.operator.config import OperatorConfig
from kvscale.operator.inference_service import ObjectKey
from kvscale.operator.kube import Kube
from kvscale.operator.reconcile import reconcile
from kvscale.operator.runtime import Runtime
from kvscale.operator.spec import LoraAdapter, parse_spec
from kvscale.server.entrypoints import cli_serve

CRD = Path(__file__).resolve().parents[2] / "crds" / "inferenceservice.yaml"
ADAPTERS = [{"name": "sql", "uri": "pvc://weights/adapters/sql"},
            {"name": "chat.v2", "uri": "hf://org/chat-lora"},
            {"name": "legal", "uri": "pvc://loras/legal/"}]
SPEC = {"model": {"uri": "pvc://weights/llama/3b", "servedName": "llama"}, "adapters": ADAPTERS,
        "engine": {"maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 8}}


def pod(spec: dict[str, Any]) -> dict[str, Any]:
    return build_deployment("chat", "team", parse_spec(spec))["spec"]["template"]["spec"]


def serve(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    cli_serve.add_arguments(parser)
    return parser.parse_args(args[1:])  # args[0] is the `serve` subcommand


def test_every_adapter_is_a_lora_module_the_server_parses_at_its_path():
    args = pod(SPEC)["containers"][0]["args"]
    parsed = serve(args)
    assert parsed.enable_lora and (parsed.max_loras, parsed.max_lora_rank, parsed.max_cpu_loras) == (2, 64, 8)
    assert [(m.name, m.path) for m in parsed.lora_modules] == [
        ("sql", "/models/pvc/weights/adapters/sql"), ("chat.v2", "/models/adapters/chat.v2"),
        ("legal", "/models/pvc/loras/legal")]
    # --lora-modules takes values up to the next flag: one of the operator's ends the list.
    after = args[args.index("--lora-modules") + len(ADAPTERS) + 1]
    assert after == "--enable-prefix-caching"


def test_without_adapters_no_lora_flag_and_the_engines_defaults_stay():
    args = pod({"model": {"uri": "bundled://smollm2-135m-instruct"}})["containers"][0]["args"]
    assert not [a for a in args if "lora" in a]
    bare = {**SPEC, "engine": {}}
    parsed = serve(pod(bare)["containers"][0]["args"])
    assert parsed.enable_lora and parsed.max_loras is None and parsed.max_lora_rank is None


def test_the_adapters_files_come_as_the_models_do():
    spec = pod(SPEC)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    # The model's claim is mounted once, for the model and its adapters; another claim read-only.
    assert [v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]
            if "persistentVolumeClaim" in v] == ["weights", "loras"]
    assert volumes["adapter-pvc-0"]["persistentVolumeClaim"] == {"claimName": "loras", "readOnly": True}
    assert mounts["adapter-pvc-0"] == {"name": "adapter-pvc-0", "mountPath": "/models/pvc/loras",
                                       "readOnly": True}
    # An hf:// adapter is fetched into the model volume, online, as the model would be.
    (fetch,) = spec["initContainers"]
    assert fetch["name"] == "fetch-adapter-0"
    assert fetch["command"] == ["hf", "download", "org/chat-lora", "--local-dir", "/models/adapters/chat.v2"]
    assert {"name": "HF_HUB_OFFLINE", "value": "0"} in fetch["env"]
    # With an hf:// model too, its fetch comes first.
    names = [c["name"] for c in pod({**SPEC, "model": {"uri": "hf://org/llama"}})["initContainers"]]
    assert names == ["fetch-model", "fetch-adapter-0"]


@pytest.mark.parametrize("adapters, match", [
    ([{"name": "a", "uri": "s3://bucket/a"}], "hf://ORG/NAME or pvc://CLAIM/PATH"),
    ([{"name": "a", "uri": "bundled://smollm2-135m-instruct"}], "hf://ORG/NAME"),
    ([{"name": "a", "uri": "pvc://claim"}], "hf://ORG/NAME"),
    ([{"name": "a", "uri": "pvc://claim/../etc"}], ". or .. segments"),
    ([{"name": "a", "uri": "hf://org/a"}, {"name": "a", "uri": "hf://org/b"}], "more than once"),
])
def test_adapters_no_pod_can_read_are_refused(adapters, match):
    with pytest.raises(ValueError, match=match):
        parse_spec({"model": {"uri": "hf://org/base"}, "adapters": adapters})


def test_the_engines_lora_settings_need_adapters():
    with pytest.raises(ValueError, match="need spec.adapters"):
        parse_spec({"model": {"uri": "hf://org/base"}, "engine": {"maxLoras": 2}})


def refused(spec: dict[str, Any], defaults: tuple[tuple[str, ...], ...] = ()) -> tuple[str, str] | None:
    condition = OperatorConfig(server_defaults=defaults).refusal(parse_spec(spec))
    return None if condition is None else (condition.reason, condition.message)


@pytest.mark.parametrize("extra, reason, words", [
    (["--lora-modules", "x=/p"], "LoraAdaptersConflict", "replace the list"),
    (["--max-loras=4"], "LoraAdaptersConflict", "override the spec's 2"),
    (["--max-lora-rank", "8"], "LoraAdaptersConflict", "--max-lora-rank"),
    (["-q", "fp8"], "LoraAdaptersUnsupported", "--quantization"),
    (["--tensor-parallel-size", "2"], "LoraAdaptersUnsupported", "2 tensor-parallel ranks"),
])
def test_flags_that_would_override_or_defeat_the_adapters_are_refused(extra, reason, words):
    spec = {**SPEC, "resources": {"gpus": 0}, "engine": {**SPEC["engine"], "extraArgs": extra}}
    got = refused(spec)
    assert got is not None and got[0] == reason and words in got[1], got
    assert "nothing is applied" in got[1]


def test_what_the_spec_leaves_to_the_flags_is_no_conflict():
    assert refused({**SPEC, "engine": {"extraArgs": ["--max-loras", "4", "--enable-lora",
                                                     "--allow-runtime-lora-updating"]}}) is None
    # Without adapters, LoRA set up in extraArgs alone is as before.
    assert refused({"model": SPEC["model"], "engine": {"extraArgs": ["--enable-lora", "--lora-modules",
                                                                     "x=/adapters/x"]}}) is None


def test_an_adapter_named_like_the_served_model_is_refused():
    spec = {"model": {"uri": "hf://org/llama"}, "adapters": [{"name": "llama", "uri": "hf://org/l"}]}
    got = refused(spec)
    assert got is not None and got[0] == "LoraAdaptersConflict" and "'llama'" in got[1]


def test_a_platform_default_yields_to_the_spec_and_fills_in_otherwise():
    defaults = servers.server_default_flags(("--max-loras=8", "--max-lora-rank=32"))
    spec = parse_spec({**SPEC, "engine": {"maxLoras": 2}})
    args = servers.server_args(servers.with_server_defaults(spec, defaults), "/models/x")
    parsed = serve(args)
    assert (parsed.max_loras, parsed.max_lora_rank) == (2, 32)
    assert refused({**SPEC, "engine": {"maxLoras": 2}}, defaults) is None


def test_a_conflict_is_synced_false_with_its_reason_and_no_children(monkeypatch):
    monkeypatch.setattr("kvscale.operator.status.kopf.event", lambda *a, **k: None)
    kube = RefusedSpecKube({**SPEC, "engine": {"extraArgs": ["--lora-modules", "x=/p"]}})
    reconcile(Runtime(kube=cast(Kube, kube), config=OperatorConfig()),
              ObjectKey(uid="u1", namespace="ns", name="chat"), logging.getLogger("test"))
    [(path, body)] = kube.writes
    assert path.endswith("/status")
    [synced] = [c for c in body["status"]["conditions"] if c["type"] == "Synced"]
    assert (synced["status"], synced["reason"]) == ("False", "LoraAdaptersConflict")


def crd_schema() -> dict[str, Any]:
    return yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_the_crd_bounds_adapters_as_the_operator_reads_them():
    schema = crd_schema()
    spec = schema["properties"]["spec"]["properties"]
    adapters = spec["adapters"]
    assert adapters["maxItems"] == 64
    assert adapters["x-kubernetes-list-type"] == "map" and adapters["x-kubernetes-list-map-keys"] == ["name"]
    item = adapters["items"]["properties"]
    assert set(item) == {"name", "uri"} == set(adapters["items"]["required"])
    name = re.compile(item["name"]["pattern"])
    for good in ("sql", "chat.v2", "Team_A-lora", "a"):
        assert name.fullmatch(good), good
    # Not name=path's '=', no path, no JSON, no space: --lora-modules reads the name as given.
    for bad in ("a=b", "org/a", "{x}", "a b", "-a", "a.", ""):
        assert not name.fullmatch(bad), bad
    # The uri rule's expressions (RE2 here as in Python) accept what parse_spec accepts.
    [rule] = item["uri"]["x-kubernetes-validations"]
    accept, reject = re.findall(r"matches\('([^']+)'\)", rule["rule"])[:2], \
        re.findall(r"!self\.matches\('([^']+)'\)", rule["rule"])
    for uri in ("hf://org/a", "pvc://weights/adapters/sql", "s3://b/a", "bundled://x",
                "pvc://claim", "pvc://Claim/a", "pvc://claim/../etc", "hf://org/..", "hf://o/a/b"):
        cel = any(re.search(p, uri) for p in accept) and not any(re.search(p, uri) for p in reject)
        try:
            parse_spec({"model": {"uri": "hf://org/base"}, "adapters": [{"name": "a", "uri": uri}]})
            python = True
        except ValueError:
            python = False
        if python != cel:  # the CRD is the stricter of the two (hf names, claim names)
            assert not cel, uri
    engine = spec["engine"]["properties"]
    assert (engine["maxLoras"]["minimum"], engine["maxLoraRank"]["minimum"]) == (1, 1)
    assert engine["maxCpuLoras"]["maximum"] == 256  # what a server registers at once
    messages = [r["message"] for r in schema["x-kubernetes-validations"]]
    assert any("need spec.adapters" in m for m in messages)
    assert any("model.servedName" in m for m in messages)


def test_an_adapters_path_is_inside_the_pod_volumes():
    assert lora_adapters.adapter_path(LoraAdapter("x", "pvc://c/a/b/")) == "/models/pvc/c/a/b"
    assert lora_adapters.adapter_path(LoraAdapter("x", "hf://o/n")) == "/models/adapters/x"


def test_the_documented_example_renders_the_documented_args():
    """docs/operator.md, "LoRA adapters": its InferenceService and the server args it shows."""
    doc = (CRD.parents[1] / "docs" / "operator.md").read_text()
    section = doc[doc.index("### LoRA adapters"):doc.index("## What the operator creates")]
    example, shown = re.findall(r"```yaml\n(.*?)```", section, re.S)[:2]
    args = pod(yaml.safe_load(example)["spec"])["containers"][0]["args"]
    lora = args[args.index("--enable-lora"):args.index("--enable-prefix-caching") + 1]
    assert " ".join(lora) in " ".join(shown.replace('"', "").replace(",", " ").split())
