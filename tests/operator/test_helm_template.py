"""Python-built objects written as a Helm template: scalars and blocks become Helm text at the
indentation of the line they stand on."""

from __future__ import annotations

import pytest

from kvscale.operator.helm_template import HelmTemplate


def test_scalars_and_blocks_become_helm_text():
    t = HelmTemplate()
    obj = {
        "metadata": {"name": t.value("$name"), "labels": {**t.include("kvscale.labels"), "a": "b"}},
        "spec": {
            "replicas": t.value("$r.replicas"),
            **t.with_key("nodeSelector", "$r.nodeSelector"),
            "resources": t.to_yaml("$r.resources"),
            "env": [{"name": "A", "value": "1"},
                    t.branches(("$r.url", [{"name": "U", "value": t.value("$r.url | quote")}]),
                               (None, [{"name": "U", "value": "none"}]))],
        },
    }
    assert t.render(obj) == """\
metadata:
  name: {{ $name }}
  labels:
    {{- include "kvscale.labels" . | nindent 4 }}
    a: b
spec:
  replicas: {{ $r.replicas }}
  {{- with $r.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  resources:
    {{- toYaml $r.resources | nindent 4 }}
  env:
  - name: A
    value: '1'
  {{- if $r.url }}
  - name: U
    value: {{ $r.url | quote }}
  {{- else }}
  - name: U
    value: none
  {{- end }}
"""


def test_a_list_shared_by_two_objects_is_written_out_twice():
    verbs = ["get", "list"]
    text = HelmTemplate().render({"rules": [{"verbs": verbs}, {"verbs": verbs}]})
    assert "&" not in text and "*" not in text and text.count("- get") == 2


def test_a_block_inside_a_string_is_refused():
    t = HelmTemplate()
    (token,) = t.include("kvscale.labels")
    with pytest.raises(ValueError, match="whole line"):
        t.render({"args": [f"--labels={token}"]})
