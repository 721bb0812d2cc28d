"""A small synchronous Kubernetes API client over httpx, speaking plain dicts.

Credentials come from the `kubernetes` package's loaders (kubeconfig with certificates, tokens or
exec plugins; or the in-cluster service account), so kopf's connection and ours are the same one.
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from typing import Any

import httpx

APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Connection:
    server: str
    ca_path: str | None
    insecure: bool
    cert_path: str | None
    key_path: str | None
    token: str | None  # "Bearer xyz" style header value, already prefixed
    default_namespace: str = "default"


def load_connection(kubeconfig: str | None = None, context: str | None = None) -> Connection:
    """From `kubeconfig` if given, else in-cluster, else $KUBECONFIG / ~/.kube/config."""
    import kubernetes.client
    import kubernetes.config

    config = kubernetes.client.Configuration()
    namespace = "default"
    if kubeconfig is None:
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
            try:
                with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
                    namespace = f.read().strip() or namespace
            except OSError:
                pass
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(context=context, client_configuration=config)
    else:
        kubernetes.config.load_kube_config(config_file=kubeconfig, context=context,
                                           client_configuration=config)
    header = (config.get_api_key_with_prefix("BearerToken")
              or config.get_api_key_with_prefix("authorization"))
    return Connection(
        server=config.host.rstrip("/"),
        ca_path=config.ssl_ca_cert or None,
        insecure=not config.verify_ssl,
        cert_path=config.cert_file or None,
        key_path=config.key_file or None,
        token=header or None,
        default_namespace=namespace,
    )


class Kube:
    def __init__(self, connection: Connection, timeout: float = 30.0):
        self.connection = connection
        tls = ssl.create_default_context(cafile=connection.ca_path)
        if connection.insecure:
            tls.check_hostname = False
            tls.verify_mode = ssl.CERT_NONE
        if connection.cert_path:
            tls.load_cert_chain(connection.cert_path, connection.key_path)
        headers = {"Accept": "application/json", "User-Agent": "kvscale-operator"}
        if connection.token:
            token = connection.token
            headers["Authorization"] = token if " " in token else f"Bearer {token}"
        self._http = httpx.Client(base_url=connection.server, verify=tls,
                                  headers=headers, timeout=timeout, trust_env=False)

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, body: Any = None, *,
                params: dict[str, Any] | None = None, content_type: str = "application/json") -> Any:
        content = None if body is None else json.dumps(body).encode()
        response = self._http.request(method, path, content=content, params=params,
                                      headers={"Content-Type": content_type} if content else None)
        if response.status_code >= 400:
            try:
                status = response.json()
                raise ApiError(response.status_code, status.get("reason", ""), status.get("message", response.text))
            except ValueError:
                raise ApiError(response.status_code, "", response.text) from None
        return response.json() if response.content else None

    def get(self, path: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        return self.request("GET", path, params=params).get("items") or []

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", path, body)

    def create_if_absent(self, path: str, body: dict[str, Any]) -> bool:
        """Create, or leave alone what exists (409): True when this call made it. Needs only the
        `create` verb: nothing is read, which is what lets the operator make Secrets it may not
        read."""
        try:
            self.create(path, body)
        except ApiError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def replace(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("PUT", path, body)

    def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", path, body, content_type=MERGE_PATCH)

    def delete(self, path: str) -> bool:
        """Delete (foreground GC of what it owns is the API server's); False when already gone."""
        try:
            self.request("DELETE", path, {"propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def apply(self, path: str, body: dict[str, Any], field_manager: str) -> dict[str, Any]:
        """Server-side apply: create or converge the fields this manager owns."""
        return self.request("PATCH", path, body, content_type=APPLY_PATCH,
                            params={"fieldManager": field_manager, "force": "true"})


def path_for(api_version: str, plural: str, namespace: str | None = None,
             name: str | None = None, subresource: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    parts = [base]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(plural)
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


PLURALS = {"Deployment": "deployments", "Service": "services", "Pod": "pods", "Secret": "secrets",
           "Lease": "leases", "ServiceAccount": "serviceaccounts", "Role": "roles",
           "RoleBinding": "rolebindings", "PodDisruptionBudget": "poddisruptionbudgets"}


def object_path(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    return path_for(obj["apiVersion"], PLURALS[obj["kind"]], meta.get("namespace"), meta["name"])
