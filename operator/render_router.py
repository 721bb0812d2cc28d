"""`kvscale operator render-router`: the namespace-wide router's objects, from the builders the
operator makes each InferenceService's router with.

Plain YAML for `kubectl apply` by default; with `--helm`, the chart's
`templates/namespace-router.yaml`, the chart's values entering where the flags would
(`make deploy-render` writes it; tests/charts checks the committed file is current).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from kvscale.operator.children.namespace_router import (
    COMPONENT,
    NamespaceRouterValues,
    namespace_router,
    namespace_router_objects,
)
from kvscale.operator.children.pod_parts import container_security_context, pod_security_context
from kvscale.operator.children.redis import redis_url_env
from kvscale.operator.children.router import RouterPod, router_api_key_env
from kvscale.operator.helm_template import HelmTemplate, dump
from kvscale.operator.spec import RedisSource, SecretKeyRef

HELM_HEADER = """\
{{- /* Written by `make deploy-render` (`kvscale operator render-router --helm`) from the
operator's router builders (operator/children/router.py, namespace_router.py): edit those, not
this file. One router for every InferenceService of a namespace, routing by the request's `model`
(`kvscale router --k8s-namespace-wide`): its own ServiceAccount may only read the EndpointSlices,
Pods and InferenceServices of that namespace. */ -}}
{{- $r := .Values.namespaceRouter }}
{{- if $r.enabled }}
{{- $name := include "kvscale.router.name" . }}
{{- $ns := include "kvscale.router.namespace" . }}
"""


def secret_key_ref(text: str, default_key: str) -> SecretKeyRef:
    name, _, key = text.partition(":")
    return SecretKeyRef(name=name, key=key or default_key)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = NamespaceRouterValues()
    parser.add_argument("--helm", action="store_true",
                        help="print the chart's template (chart values instead of these flags)")
    parser.add_argument("--helm-security", action="store_true",
                        help="print the chart's security-context templates (every pod of the chart)")
    parser.add_argument("--namespace", dest="router_namespace", default=defaults.namespace,
                        help="namespace whose InferenceServices it serves, and where it runs")
    parser.add_argument("--name", dest="router_name", default=defaults.name, help="object names")
    parser.add_argument("--instance", default=defaults.instance, help="app.kubernetes.io/instance")
    parser.add_argument("--image", default=defaults.image, help="the control-plane image")
    parser.add_argument("--replicas", type=int, default=defaults.replicas)
    parser.add_argument("--policy", default=defaults.policy, help="kvscale router --policy")
    redis = parser.add_mutually_exclusive_group()
    redis.add_argument("--redis-url", default=None,
                       help="the KV index all the namespace's servers publish to")
    redis.add_argument("--redis-secret", default=None, metavar="NAME[:KEY]",
                       help="that URL from a Secret (key default: url)")
    parser.add_argument("--api-key-secret", default=None, metavar="NAME[:KEY]",
                        help="the key clients must send, and that it sends on (key default: api-key)")
    parser.add_argument("--service-type", default=defaults.service_type)
    parser.add_argument("--service-port", type=int, default=defaults.service_port)


def values_from_args(args: argparse.Namespace) -> NamespaceRouterValues:
    return NamespaceRouterValues(
        namespace=args.router_namespace,
        name=args.router_name,
        instance=args.instance,
        image=args.image,
        replicas=args.replicas,
        policy=args.policy,
        redis=RedisSource(
            url=args.redis_url,
            secret_ref=None if args.redis_secret is None else secret_key_ref(args.redis_secret, "url")),
        api_key_secret=(None if args.api_key_secret is None
                        else secret_key_ref(args.api_key_secret, "api-key")),
        service_type=args.service_type,
        service_port=args.service_port,
    )


def render_plain(values: NamespaceRouterValues) -> str:
    pod = namespace_router(values)
    objects = namespace_router_objects(pod, values.service_type, values.service_port)
    if isinstance(values.replicas, int) and values.replicas < 2:
        objects = [o for o in objects if o["kind"] != "PodDisruptionBudget"]  # as the chart
    return "---\n".join(dump(o) for o in objects)


def helm_router(t: HelmTemplate) -> RouterPod:
    """The namespace-wide router with the chart's values in it."""
    values = NamespaceRouterValues(
        namespace=t.value("$ns"),
        name=t.value("$name"),
        image=t.value('include "kvscale.image" (dict "image" .Values.images.controlPlane "root" .)'),
        replicas=t.value("$r.replicas"),
        policy=t.value("$r.policy"),
        resources=t.to_yaml("$r.resources"),
    )
    secret = SecretKeyRef(t.value("$r.redis.existingSecret.name"), t.value("$r.redis.existingSecret.key"))
    redis_env = t.branches(
        ("$r.redis.existingSecret.name", redis_url_env(RedisSource(secret_ref=secret), None)),
        ("$r.redis.url", redis_url_env(RedisSource(url=t.value("$r.redis.url | quote")), None)),
    )
    api_key = SecretKeyRef(t.value("$r.apiKeySecret.name"), t.value("$r.apiKeySecret.key"))
    api_key_env = t.branches(("$r.apiKeySecret.name", router_api_key_env(api_key)))
    return replace(
        namespace_router(values),
        labels={**t.include("kvscale.labels"), "app.kubernetes.io/component": COMPONENT},
        selector=t.include("kvscale.router.selectorLabels"),
        env=(redis_env, api_key_env),
        annotations=t.items_of("$r.podAnnotations"),
        container_extras={"imagePullPolicy": t.value(".Values.images.pullPolicy")},
        pod_extras={**t.with_key("imagePullSecrets", ".Values.images.pullSecrets"),
                    **t.with_key("nodeSelector", "$r.nodeSelector"),
                    **t.with_key("tolerations", "$r.tolerations")},
    )


def render_helm() -> str:
    t = HelmTemplate()
    objects = namespace_router_objects(helm_router(t), t.value("$r.service.type"),
                                       t.value("$r.service.port"))
    always = [o for o in objects if o["kind"] != "PodDisruptionBudget"]
    pdb = next(o for o in objects if o["kind"] == "PodDisruptionBudget")
    return (HELM_HEADER + "---\n".join(t.render(o) for o in always)
            # One replica: a PDB allowing one disruption would protect nothing.
            + "{{- if gt (int $r.replicas) 1 }}\n---\n" + t.render(pdb) + "{{- end }}\n{{- end }}\n")


def render_helm_security() -> str:
    """The chart's `kvscale.podSecurityContext` and `kvscale.containerSecurityContext`: the
    operator's and the helm test pods' security, the same as every pod the operator makes."""
    return (
        "{{/* Written by `make deploy-render` (`kvscale operator render-router --helm-security`) from\n"
        "operator/children/pod_parts.py: edit that, not this file. Restricted Pod Security. */}}\n"
        '{{- define "kvscale.podSecurityContext" -}}\n' + dump(pod_security_context()) + "{{- end -}}\n\n"
        '{{- define "kvscale.containerSecurityContext" -}}\n' + dump(container_security_context())
        + "{{- end -}}\n")


def run(args: argparse.Namespace) -> int:
    if args.helm_security:
        sys.stdout.write(render_helm_security())
    elif args.helm:
        sys.stdout.write(render_helm())
    else:
        sys.stdout.write(render_plain(values_from_args(args)))
    return 0
