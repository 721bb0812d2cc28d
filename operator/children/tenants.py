"""A router's tenants (`spec.router.tenants`) as the router reads them, built without a Secret's
value: the tenants file in a ConfigMap that names an environment variable per tenant
(`api_key_env`), and those variables set in the router pod from the tenants' Secrets
(docs/operator.md, "Tenants"). The operator may not read Secrets (docs/operator.md, "RBAC"), and
does not need to: the kubelet puts the keys in the router's environment, the router hashes them
when it loads the file.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvscale.operator.children.labels import router_labels, router_name
from kvscale.operator.children.pod_parts import EnvVar, secret_env
from kvscale.operator.spec import TenantSpec

MOUNT_PATH = "/etc/kvscale/tenants"
FILE_NAME = "tenants.yaml"
VOLUME = "tenants"


def tenants_config_map_name(name: str) -> str:
    return f"{router_name(name)}-tenants"


def key_env_name(index: int) -> str:
    """The router's variable holding tenant ``index``'s key: by position, since a tenant's name
    may hold '.' and '-', which a variable's name may not."""
    return f"KVSCALE_TENANT_KEY_{index}"


def tenants_file(tenants: tuple[TenantSpec, ...]) -> str:
    """The router's --tenants file (docs/router.md, "Tenants"): variable names, no key."""
    entries = []
    for index, tenant in enumerate(tenants):
        entry: dict[str, Any] = {"name": tenant.name, "api_key_env": key_env_name(index)}
        if tenant.requests_per_minute is not None:
            entry["requests_per_minute"] = tenant.requests_per_minute
        if tenant.tokens_per_minute is not None:
            entry["tokens_per_minute"] = tenant.tokens_per_minute
        entries.append(entry | {"weight": tenant.weight, "priority": tenant.priority})
    return yaml.safe_dump(entries, sort_keys=False)


def build_tenants_config_map(name: str, namespace: str,
                             tenants: tuple[TenantSpec, ...]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": tenants_config_map_name(name), "namespace": namespace,
                     "labels": router_labels(name)},
        "data": {FILE_NAME: tenants_file(tenants)},
    }


def tenants_env(tenants: tuple[TenantSpec, ...]) -> list[EnvVar]:
    """Each tenant's key from its Secret, in the variable the file names."""
    return [secret_env(key_env_name(i), t.api_key_secret) for i, t in enumerate(tenants)]


def tenants_args() -> list[str]:
    return ["--tenants", f"{MOUNT_PATH}/{FILE_NAME}"]


def tenants_volume(name: str) -> dict[str, Any]:
    return {"name": VOLUME, "configMap": {"name": tenants_config_map_name(name)}}


def tenants_mount() -> dict[str, Any]:
    # A directory mount, not subPath: the kubelet swaps the file in place when the ConfigMap
    # changes, and the router re-reads it (docs/router.md, "Tenants").
    return {"name": VOLUME, "mountPath": MOUNT_PATH, "readOnly": True}
