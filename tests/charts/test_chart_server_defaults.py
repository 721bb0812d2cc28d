"""operator.serverDefaultArgs reaches every server: the chart renders it as the operator's
repeated --server-default-arg, which the operator puts in each server's args (an
InferenceService's engine.extraArgs still winning); the schema keeps out what is no flag."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from chart_helpers import CHART
from test_chart_images import operator_config, operator_container

from kvscale.operator.children.owned import build_children
from kvscale.operator.children.servers import RESERVED_FLAGS
from kvscale.operator.config import OperatorConfig
from kvscale.operator.spec import parse_spec

pytestmark = pytest.mark.slow  # needs helm (tools/k8s-bins.sh), as the other chart tests


def server_args(config: OperatorConfig, spec: dict) -> list[str]:
    (servers,) = [c for c in build_children("chat", "team", parse_spec(spec), config.images,
                                            config.server_defaults)
                  if c["kind"] == "Deployment" and c["metadata"]["name"] == "chat"]
    return servers["spec"]["template"]["spec"]["containers"][0]["args"]


def test_server_default_args_reach_every_server(helm):
    container = operator_container(helm, "operator.serverDefaultArgs={--max-tools=64,--max-queue-len=8192}")
    rendered = [a for a in container["args"] if a.startswith("--server-default-arg")]
    assert rendered == ["--server-default-arg=--max-tools=64", "--server-default-arg=--max-queue-len=8192"]
    config = operator_config(container)
    assert config.server_defaults == (("--max-tools=64",), ("--max-queue-len=8192",))
    model = {"uri": "bundled://smollm2-135m-instruct"}
    assert server_args(config, {"model": model})[-2:] == ["--max-tools=64", "--max-queue-len=8192"]
    own = server_args(config, {"model": model, "engine": {"extraArgs": ["--max-queue-len", "100"]}})
    assert own[-3:] == ["--max-tools=64", "--max-queue-len", "100"] and "--max-queue-len=8192" not in own


def test_no_server_default_args_by_default(helm):
    container = operator_container(helm)
    assert not [a for a in container["args"] if a.startswith("--server-default-arg")]
    assert operator_config(container).server_defaults == ()


def test_a_value_with_spaces_or_yaml_syntax_renders_as_one_arg(helm, tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text('operator:\n  serverDefaultArgs: ["--structured-outputs-config", '
                      '\'{"backend": "guidance", "cache_size": 64}\', "--stream-interval=2 #: y"]\n')
    proc = helm.run("template", "kvscale", str(CHART), "--values", str(values),
                    "--show-only", "templates/operator.yaml")
    (rendered,) = [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "Deployment"]
    args = rendered["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--server-default-arg")] == [
        "--server-default-arg=--structured-outputs-config",
        '--server-default-arg={"backend": "guidance", "cache_size": 64}',
        "--server-default-arg=--stream-interval=2 #: y"]


@pytest.mark.parametrize(("value", "message"), [
    ("operator.serverDefaultArgs=--max-tools=64", "got string, want array"),
    ("operator.serverDefaultArgs={--max-tools=64,--port=9000}", "operator/serverDefaultArgs/1"),
    ("operator.serverDefaultArgs={--no-enable-prefix-caching}", "operator/serverDefaultArgs/0"),
])
def test_the_schema_refuses_no_list_and_the_operators_own_flags(helm, value, message):
    result = helm.run("template", "kvscale", str(CHART), "--set", value, check=False)
    assert result.returncode != 0 and message in result.stderr


def test_the_schema_refuses_exactly_the_flags_the_operator_refuses():
    schema = json.loads((CHART / "values.schema.json").read_text())
    pattern = schema["properties"]["operator"]["properties"]["serverDefaultArgs"]["items"]["not"]["pattern"]
    assert {f"--{name}" for name in re.search(r"\)\?\((.*)\)\(", pattern)[1].split("|")} | {
        "--no-enable-prefix-caching"} == RESERVED_FLAGS
    for flag in sorted(RESERVED_FLAGS):
        assert re.search(pattern, flag) and re.search(pattern, flag + "=1")
    assert not re.search(pattern, "--max-tools=64") and not re.search(pattern, "--models-dir=x")
