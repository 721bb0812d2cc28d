"""A small synchronous Kubernetes API client over httpx, speaking plain dicts.

Credentials come from the `kubernetes` package's loaders (kubeconfig with certificates, tokens or
exec plugins; or the in-cluster service account), so kopf's connection and ours are the same one.
In a pod the service-account token is a file the kubelet rotates (a bound token lives an hour or
so): it is read again each minute, as client-go does, and at once after a 401 (docs/operator.md,
"Running the operator").
"""

from __future__ import annotations

import json
import ssl
import threading
import time
from collections.abc import Generator
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
    token_file: str | None = None  # in a pod: the rotated service-account token, read again

    def current_token(self) -> str | None:
        """The bearer token now, unprefixed: the file's contents when there is one (read
        afresh), else `token`'s."""
        if self.token_file:
            try:
                with open(self.token_file) as f:
                    if text := f.read().strip():
                        return text
            except OSError:
                pass
        return self.token.split(" ", 1)[-1] if self.token else None


SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
TOKEN_REREAD_S = 60.0  # client-go's cached token file source re-reads every minute


class TokenFileAuth(httpx.Auth):
    """A bearer token read from `connection.token_file` each `reread_s`, and again (with one
    retry) when the API server answers 401: the kubelet rotated it."""

    def __init__(self, connection: Connection, reread_s: float = TOKEN_REREAD_S):
        self.connection = connection
        self.reread_s = reread_s
        self._token = connection.current_token() or ""
        self._read_at = time.monotonic()
        self._lock = threading.Lock()

    def token(self, force: bool = False) -> str:
        with self._lock:
            if force or time.monotonic() - self._read_at >= self.reread_s:
                self._token = self.connection.current_token() or self._token
                self._read_at = time.monotonic()
            return self._token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        sent = self.token()
        request.headers["Authorization"] = f"Bearer {sent}"
        response = yield request
        if response.status_code == 401 and self.token(force=True) != sent:
            request.headers["Authorization"] = f"Bearer {self._token}"
            yield request


def load_connection(kubeconfig: str | None = None, context: str | None = None) -> Connection:
    """From `kubeconfig` if given, else in-cluster, else $KUBECONFIG / ~/.kube/config."""
    import kubernetes.client
    import kubernetes.config

    config = kubernetes.client.Configuration()
    namespace = "default"
    in_cluster = False
    if kubeconfig is None:
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
            in_cluster = True
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
        token_file=SERVICE_ACCOUNT_TOKEN if in_cluster else None,
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
        auth: httpx.Auth | None = None
        if connection.token_file:
            auth = TokenFileAuth(connection)
        elif connection.token:
            token = connection.token
            headers["Authorization"] = token if " " in token else f"Bearer {token}"
        self._http = httpx.Client(base_url=connection.server, verify=tls, auth=auth,
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
           "RoleBinding": "rolebindings", "PodDisruptionBudget": "poddisruptionbudgets",
           "ConfigMap": "configmaps", "InferencePool": "inferencepools",
           "LeaderWorkerSet": "leaderworkersets"}


def object_path(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    return path_for(obj["apiVersion"], PLURALS[obj["kind"]], meta.get("namespace"), meta["name"])
