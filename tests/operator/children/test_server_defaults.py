"""The platform's server defaults (`kvscale operator --server-default-arg`, the chart's
`operator.serverDefaultArgs`): in every server's args, each one dropped where the
InferenceService's own engine.extraArgs sets that flag; refused at start for a flag the operator
sets itself or a list that is not `kvscale serve` flags."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from kvscale.operator import cli_operator
from kvscale.operator.children import servers
from kvscale.operator.children.owned import build_children
from kvscale.operator.config import OperatorConfig, config_from_args
from kvscale.operator.spec import parse_spec
from kvscale.server.entrypoints import cli_serve

REPO_ROOT = Path(__file__).resolve().parents[3]
MODEL = {"uri": "bundled://smollm2-135m-instruct"}
FLEET = ("--max-tools=64", "--max-queue-len", "8192", "--max-stop-strings=16")


def server_args(spec: dict, defaults: tuple[str, ...]) -> list[str]:
    (deployment,) = [c for c in build_children("chat", "team", parse_spec(spec), None,
                                               servers.server_default_flags(defaults))
                     if c["kind"] == "Deployment" and c["metadata"]["name"] == "chat"]
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    cli_serve.add_arguments(parser)
    return parser


def test_every_server_gets_the_defaults_after_the_operators_flags():
    args = server_args({"model": MODEL}, FLEET)
    assert args[-4:] == list(FLEET)
    parsed = serve_parser().parse_args(args[1:])
    assert (parsed.max_tools, parsed.max_queue_len, parsed.max_stop_strings) == (64, 8192, 16)
    assert server_args({"model": MODEL}, ()) == servers.server_args(parse_spec({"model": MODEL}), None)


@pytest.mark.parametrize("override", [["--max-queue-len=100"], ["--max-queue-len", "100"]])
def test_extra_args_win_and_the_default_for_that_flag_is_dropped(override):
    args = server_args({"model": MODEL, "engine": {"extraArgs": override}}, FLEET)
    assert args[-len(override) - 2:] == ["--max-tools=64", "--max-stop-strings=16", *override]
    assert "8192" not in args and sum(a.startswith("--max-queue-len") for a in args) == 1
    parsed = serve_parser().parse_args(args[1:])
    assert (parsed.max_tools, parsed.max_queue_len, parsed.max_stop_strings) == (64, 100, 16)


def test_a_negated_switch_in_extra_args_drops_the_default_switch():
    args = server_args({"model": MODEL, "engine": {"extraArgs": ["--no-async-scheduling"]}},
                       ("--async-scheduling",))
    assert "--async-scheduling" not in args and args[-1] == "--no-async-scheduling"


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def router_args(spec: dict, defaults: tuple[str, ...]) -> list[str]:
    (router,) = [c for c in build_children("chat", "team", parse_spec(spec), None,
                                           servers.server_default_flags(defaults))
                 if c["kind"] == "Deployment" and c["metadata"]["name"] == "chat-router"]
    return router["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_router_tokenizes_with_the_tool_format_the_servers_run_with():
    """The router renders tools as its servers do: a default --tool-call-parser reaches it, and
    an InferenceService's own wins there too."""
    fleet = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert flag(router_args({"model": MODEL}, fleet), "--tool-call-parser") == "hermes"
    own = {"model": MODEL, "engine": {"extraArgs": ["--tool-call-parser=llama3_json"]}}
    assert flag(router_args(own, fleet), "--tool-call-parser") == "llama3_json"
    assert server_args(own, fleet)[-2:] == ["--enable-auto-tool-choice", "--tool-call-parser=llama3_json"]


def parse_operator(*argv: str) -> OperatorConfig:
    parser = argparse.ArgumentParser()
    cli_operator.add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_the_operator_flag_is_repeatable_and_keeps_the_order():
    config = parse_operator(*(f"--server-default-arg={arg}" for arg in FLEET))
    assert config.server_defaults == (("--max-tools=64",), ("--max-queue-len", "8192"), ("--max-stop-strings=16",))
    assert parse_operator().server_defaults == ()


@pytest.mark.parametrize("defaults, named", [
    (["--port=9000"], "--port"),
    (["--max-num-seqs", "8"], "--max-num-seqs"),
    (["--no-enable-prefix-caching"], "--no-enable-prefix-caching"),
    (["--no-async-scheduling", "--no-enable-prefix-caching=1"], "--no-enable-prefix-caching"),
    (["--api-key=secret"], "--api-key"),
    (["--kv-cache-memory-bytes=1"], "--kv-cache-memory-bytes"),
])
def test_a_default_for_a_flag_the_operator_sets_is_refused_at_start(defaults, named):
    with pytest.raises(SystemExit, match=re.escape(named)) as refused:
        parse_operator(*(f"--server-default-arg={arg}" for arg in defaults))
    assert "--server-default-arg" in str(refused.value) and "serverDefaultArgs" in str(refused.value)


@pytest.mark.parametrize("defaults", [["64"], ["-q", "int8"], ["--max-tools", "64", "128"],
                                      ["--"], ["--Max-Tools=64"], ["--max tools=64"]])
def test_what_is_not_a_list_of_flags_is_refused_at_start(defaults):
    with pytest.raises(SystemExit, match="--server-default-arg"):
        parse_operator(*(f"--server-default-arg={arg}" for arg in defaults))


def test_the_reserved_flags_are_what_the_operator_sets_and_real_serve_flags():
    """Every flag the operator can put in a server's args, and every one the CRD keeps out of
    engine.extraArgs, is reserved; each is one `kvscale serve` accepts."""
    full = parse_spec({"model": {"uri": "pvc://weights/llama/3b"}, "resources": {"gpus": 0},
                       "engine": {"maxNumBatchedTokens": 4096, "maxModelLen": 2048}})
    emitted = {a.split("=", 1)[0] for a in servers.server_args(full, "/models/x") if a.startswith("--")}
    assert emitted <= servers.RESERVED_FLAGS
    crd = (REPO_ROOT / "crds" / "inferenceservice.yaml").read_text()
    rule = yaml.safe_load(crd)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"]["properties"]["engine"]["properties"]["extraArgs"]["x-kubernetes-validations"][0]["rule"]
    assert set(re.findall(r"'(--[a-z-]+)'", rule)) <= servers.RESERVED_FLAGS
    accepted = {s for action in serve_parser()._actions for s in action.option_strings}
    assert servers.RESERVED_FLAGS <= accepted


def test_the_request_limits_are_serve_flags_a_default_may_set():
    accepted = {s for action in serve_parser()._actions for s in action.option_strings}
    limits = {"--max-sequences-per-request", "--max-stop-strings", "--max-stop-string-length",
              "--max-stop-token-ids", "--max-logit-bias", "--max-structured-output-bytes",
              "--max-tools", "--max-queue-len", "--max-prompts-per-request"}
    assert limits <= accepted and not limits & servers.RESERVED_FLAGS
    defaults = tuple(f"{name}=7" for name in sorted(limits))
    assert parse_operator(*(f"--server-default-arg={arg}" for arg in defaults)).server_defaults == tuple(
        (arg,) for arg in defaults)
