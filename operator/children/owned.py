"""Everything one InferenceService owns, built from its spec, and what its spec no longer wants."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvscale.operator.children.inference_pool import (
    build_picker_service,
    picker_service_name,
    pool_wanted,
)
from kvscale.operator.children.labels import ranks_selector, redis_name, router_name
from kvscale.operator.children.leader_worker_set import API_VERSION as LWS_API_VERSION
from kvscale.operator.children.leader_worker_set import PLURAL as LWS_PLURAL
from kvscale.operator.children.leader_worker_set import (
    build_leader_worker_set,
    leader_worker_set_name,
)
from kvscale.operator.children.redis import build_redis_deployment, build_redis_service
from kvscale.operator.children.router import (
    build_router_deployment,
    build_router_pdb,
    build_router_rbac,
    service_router,
)
from kvscale.operator.children.servers import (
    build_deployment,
    build_headless_service,
    build_server_pdb,
    build_service,
    with_server_defaults,
)
from kvscale.operator.children.tenants import build_tenants_config_map, tenants_config_map_name
from kvscale.operator.spec import (
    DEFAULT_IMAGE,
    DEFAULT_REDIS_IMAGE,
    DEFAULT_ROUTER_IMAGE,
    InferenceServiceSpec,
)


@dataclass(frozen=True)
class Images:
    """The images the operator runs: `engine` for servers whose spec names no image of its own."""

    router: str = DEFAULT_ROUTER_IMAGE
    redis: str = DEFAULT_REDIS_IMAGE
    engine: str = DEFAULT_IMAGE


def build_children(name: str, namespace: str, spec: InferenceServiceSpec,
                   images: Images | None = None,
                   server_defaults: Sequence[Sequence[str]] = ()) -> list[dict[str, Any]]:
    """Everything applied on every reconcile (the generated Redis Secret is created once, apart);
    ``server_defaults``: `kvscale serve` flags for every server, one group per flag
    (servers.server_default_flags, servers.with_server_defaults)."""
    images = images or Images()
    if not spec.image:
        spec = replace(spec, image=images.engine)
    spec = with_server_defaults(spec, server_defaults)
    # A replica over several nodes is a LeaderWorkerSet's group (children/leader_worker_set.py).
    multi_node = spec.engine.nodes > 1
    children = [
        build_leader_worker_set(name, namespace, spec) if multi_node else build_deployment(name, namespace, spec),
        build_server_pdb(name, namespace, ranks_selector(name) if multi_node else None),
        build_service(name, namespace, spec),
        build_headless_service(name, namespace),
    ]
    if spec.router.enabled:
        router = service_router(name, namespace, spec, images.router)
        children += [*build_router_rbac(router), build_router_deployment(router),
                     build_router_pdb(router)]
        if pool_wanted(spec):
            # The InferencePool itself is applied apart, once its CRD is served (gateway_pool.py).
            children.append(build_picker_service(name, namespace, spec))
        if spec.router.tenants:
            children.append(build_tenants_config_map(name, namespace, spec.router.tenants))
        if not spec.router.redis.external:
            children += [build_redis_deployment(name, namespace, images.redis),
                         build_redis_service(name, namespace)]
    return children


def unwanted_children(name: str, namespace: str, spec: InferenceServiceSpec,
                      lws_served: bool = False) -> list[tuple[str, str, str]]:
    """(apiVersion, plural, name) of optional children this spec no longer wants, to delete;
    ``lws_served``: whether LeaderWorkerSets are (else there is none to look for)."""
    unwanted: list[tuple[str, str, str]] = []
    if spec.engine.nodes > 1:
        unwanted.append(("apps/v1", "deployments", name))
    elif lws_served:
        unwanted.append((LWS_API_VERSION, LWS_PLURAL, leader_worker_set_name(name)))
    if not spec.router.enabled:
        router = router_name(name)
        unwanted += [("apps/v1", "deployments", router), ("policy/v1", "poddisruptionbudgets", router),
                     ("rbac.authorization.k8s.io/v1", "rolebindings", router),
                     ("rbac.authorization.k8s.io/v1", "roles", router), ("v1", "serviceaccounts", router)]
    if not pool_wanted(spec):
        unwanted.append(("v1", "services", picker_service_name(name)))
    if not spec.router.enabled or not spec.router.tenants:
        unwanted.append(("v1", "configmaps", tenants_config_map_name(name)))
    if not spec.router.enabled or spec.router.redis.external:
        redis = redis_name(name)
        # Not its Secret: the operator may not read Secrets (to check who owns a same-named one)
        # nor delete them. The garbage collector removes it with the InferenceService; a router
        # switched on again reuses its password.
        unwanted += [("apps/v1", "deployments", redis), ("v1", "services", redis)]
    return unwanted
