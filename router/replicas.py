"""The replicas a router may send to: where they are, what they serve, whether they are up.

Sources: a static list of base URLs, or the ready endpoints of a headless Service's
EndpointSlices (watched with the ``kubernetes`` client). A replica is routable while its last
health check passed and — when Redis heartbeats are available — its heartbeat has not expired.
A connection error while proxying marks it down at once; the next passing check brings it back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from kvscale.base_urls import authority, base_url, normalize_base_url
from kvscale.k8s_labels import SERVERS_ENDPOINTS_SELECTOR

if TYPE_CHECKING:
    from kubernetes.watch import Watch

log = logging.getLogger("kvscale.router.replicas")

def default_replica_id(url: str) -> str:
    """What `kvscale serve` uses as replica id when none is given: host:port."""
    return authority(url)


@dataclass
class Replica:
    url: str
    replica_id: str  # the id its KV events and heartbeats carry
    models: set[str] = field(default_factory=set)
    # The LoRA adapters among ``models`` (/v1/models' cards with a ``parent``), each with its parent.
    adapters: dict[str, str] = field(default_factory=dict)
    healthy: bool = False
    in_flight: int = 0  # requests this router has open on it
    last_finished: float = 0.0  # this router's monotonic clock when one of those last ended
    last_check: float = 0.0
    consecutive_failures: int = 0
    status: str = "not checked yet"  # the last health check's verdict, "ok" or why not (/health)


def read_models(replica: Replica, cards: list[dict[str, Any]]) -> None:
    """What ``replica`` serves, from its /v1/models cards: every id, and the adapters' parents."""
    replica.models = {m["id"] for m in cards}
    replica.adapters = {m["id"]: str(m["parent"]) for m in cards if m.get("parent")}


class HealthFollower(Protocol):
    """Work that follows the health checks (router/lora_replay.py): told after every pass, closed
    with the set."""

    def checked(self) -> None: ...  # starts what it does; never waits on it

    async def close(self) -> None: ...


# Failed checks (timeouts, 5xx) in a row before a healthy replica is taken out: one slow answer
# (a GC pause, a throttled node) must not empty the fleet. A refused connection or a replica that
# says it is draining is taken out at once.
FAILURES_TO_MARK_DOWN = 3
# One check (its /health and, when needed, /v1/models) ends within this, whatever the HTTP client
# does: the checks of every replica go out together and the next pass waits for all of them, so a
# check that hangs past the client's own timeouts would stop the router seeing any replica change.
CHECK_DEADLINE_S = 5.0


def describe_check(path: str, status_code: int, api_key: str | None, code: str | None = None) -> str:
    """A health check's verdict from one answer: "ok", or why the replica is not routable, in
    words an operator can act on (the router's log and /health show it)."""
    if status_code == 200:
        return "ok"
    if status_code in (401, 403):
        if api_key is None:
            return (f"{path} answered {status_code}: the replica requires an API key and the router sends "
                    "none; give the router --replica-api-key (or KVSCALE_REPLICA_API_KEY)")
        return f"{path} answered {status_code}: the replica rejects the key the router sends (--replica-api-key)"
    if status_code == 503 and code == "draining":
        return f"{path} answered 503: draining (shutting down)"
    return f"{path} answered {status_code}" + (f" ({code})" if code else "")


def check_state(status: str) -> str:
    """What a verdict says about the replica, without the detail that changes between checks (a
    dying process answers with a reset, then a refused connection: one state, logged once)."""
    return "cannot connect" if status.startswith("cannot connect") else status


def _error_code(response: httpx.Response) -> str | None:
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


class ReplicaSet:
    def __init__(
        self,
        api_key: str | None = None,
        health_interval_s: float = 2.0,
        on_removed: Callable[[Replica], None] | None = None,
        on_renamed: Callable[[str, str], None] | None = None,
    ) -> None:
        self.replicas: dict[str, Replica] = {}  # url -> replica
        self.api_key = api_key
        self._on_removed = on_removed
        self._on_renamed = on_renamed  # (old id, new id): a heartbeat named a replica
        self.health_interval_s = health_interval_s
        self.check_deadline_s = CHECK_DEADLINE_S
        self._task: asyncio.Task | None = None
        self._client: httpx.AsyncClient | None = None
        self._changed = asyncio.Event()
        self.followers: list[HealthFollower] = []

    def set_urls(self, urls: list[str]) -> None:
        wanted = {normalize_base_url(u) for u in urls if u.strip()}
        for url in list(self.replicas):
            if url not in wanted:
                log.info("replica %s removed", url)
                removed = self.replicas.pop(url)
                if self._on_removed is not None:
                    self._on_removed(removed)
        for url in sorted(wanted):
            if url not in self.replicas:
                log.info("replica %s added", url)
                self.replicas[url] = Replica(url=url, replica_id=default_replica_id(url))
        self._changed.set()

    def by_id(self) -> dict[str, Replica]:
        return {r.replica_id: r for r in self.replicas.values()}

    def bind_heartbeat_ids(self, url_to_id: dict[str, str]) -> None:
        """Heartbeats name each replica's id and base URL; learn the id of every URL we route to."""
        for url, replica_id in url_to_id.items():
            replica = self.replicas.get(normalize_base_url(url))
            if replica is not None and replica.replica_id != replica_id:
                old, replica.replica_id = replica.replica_id, replica_id
                if self._on_renamed is not None:
                    self._on_renamed(old, replica_id)

    def mark_down(self, replica: Replica, at_once: bool = True) -> None:
        """A request to ``replica`` failed: out at once when ``at_once`` (its connection was
        refused), else once FAILURES_TO_MARK_DOWN failures come in a row."""
        replica.consecutive_failures += 1
        if not (at_once or replica.consecutive_failures >= FAILURES_TO_MARK_DOWN):
            return
        if replica.healthy:
            log.warning("replica %s marked down after %d failed request(s)", replica.url,
                        replica.consecutive_failures)
        replica.healthy = False

    def mark_draining(self, replica: Replica) -> None:
        """Route around a replica that said it is shutting down (its /health answers 503 too, so
        health checks keep it out until it is gone or back)."""
        if replica.healthy:
            log.warning("replica %s is draining (shutting down); routing around it", replica.url)
        replica.healthy = False
        replica.status = describe_check("/health", 503, None, "draining")  # what its next check says

    # -- health checks ------------------------------------------------------------------------
    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(2.0), headers=headers)
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="replica-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._client is not None:
            await self._client.aclose()
        for follower in self.followers:
            await follower.close()

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._changed.wait(), self.health_interval_s)
            except TimeoutError:
                pass
            self._changed.clear()
            try:
                await self.check_all()
            except Exception:
                # The loop is the router's only view of its replicas: if it ended, a replica that
                # died or came back would never be seen to (docs/router.md, "Failures").
                log.exception("a pass of the replicas' health checks failed; the next one runs as usual")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in list(self.replicas.values())))
        for follower in self.followers:
            follower.checked()

    async def check(self, replica: Replica) -> None:
        assert self._client is not None
        at_once = False  # a failure that takes a healthy replica out without waiting for more
        try:
            async with asyncio.timeout(self.check_deadline_s):
                health = await self._client.get(f"{replica.url}/health")
                status = describe_check("/health", health.status_code, self.api_key, _error_code(health))
                if status == "ok" and (not replica.models or not replica.healthy):
                    # /health is open to probes; the API is where a missing or wrong key shows.
                    models = await self._client.get(f"{replica.url}/v1/models")
                    status = describe_check("/v1/models", models.status_code, self.api_key, _error_code(models))
                    if status == "ok":
                        read_models(replica, models.json().get("data", []))
        except TimeoutError:
            status = f"no answer within {self.check_deadline_s:g} s"
        except httpx.HTTPError as exc:
            status = f"cannot connect: {type(exc).__name__}: {exc}"
            at_once = isinstance(exc, httpx.ConnectError)  # refused: nothing listens there
        except (ValueError, KeyError, TypeError) as exc:
            status = f"/v1/models answered an unreadable body: {exc!r}"
        except Exception as exc:
            # The HTTP stack's own faults count as a failed check, never as the end of the checks:
            # anyio raises AttributeError when a replica resets the connection as it is made.
            status = f"the check failed: {type(exc).__name__}: {exc}"
        # A replica that says it is draining, or refuses the router's key, will not get better.
        at_once = at_once or "draining" in status or " answered 401" in status or " answered 403" in status
        ok = status == "ok"
        failures = 0 if ok else replica.consecutive_failures + 1
        if not ok and replica.healthy and not at_once and failures < FAILURES_TO_MARK_DOWN:
            # One slow or failed check: still routable; the next ones decide.
            replica.consecutive_failures = failures
            replica.last_check = time.monotonic()
            return
        if ok and not replica.healthy:
            log.info("replica %s is healthy (models: %s)", replica.url, ", ".join(sorted(replica.models)))
        if not ok and (check_state(status) != check_state(replica.status) or replica.healthy):
            # Once per replica and state: a check every 2 s must not flood the log.
            log.warning("replica %s is not routable: %s", replica.url, status)
        replica.status = status
        replica.healthy = ok
        replica.consecutive_failures = failures
        replica.last_check = time.monotonic()


# Every call to the API server is bounded (connect, read seconds): the client's default waits
# forever on an API server that accepted and went silent. A watch's read bound leaves room past
# its own server-side timeout.
K8S_TIMEOUT_S = (5.0, 30.0)
WATCH_TIMEOUT_S = 60


def kube_api_client(kubeconfig: str | None = None) -> Any:
    """A kubernetes ApiClient: in-cluster (the pod's ServiceAccount) unless ``kubeconfig`` names
    a file; outside a pod, $KUBECONFIG or ~/.kube/config. In a pod the token file is read again
    once a minute (the client's refresh hook): the kubelet rotates the projected token."""
    from kubernetes import client, config

    if kubeconfig is None:
        try:
            configuration = client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
            return client.ApiClient(configuration)
        except config.ConfigException:
            pass
    # The client reads $KUBECONFIG once, when first imported; read it now. Our own ApiClient
    # leaves the process-wide default configuration alone.
    path = kubeconfig or os.environ.get("KUBECONFIG") or None
    return config.new_client_from_config(config_file=path, persist_config=False)


class EndpointSliceWatch:
    """Ready endpoints of a headless Service, from its EndpointSlices, pushed into a ReplicaSet.

    The kubernetes client's watch blocks, so it runs in a thread and hands URL lists to the
    router's loop with ``call_soon_threadsafe`` (only when the set of URLs changes).
    """

    def __init__(
        self,
        service: str | None,
        namespace: str,
        on_urls: Callable[[list[str]], None],
        loop: asyncio.AbstractEventLoop,
        port_name: str | None = None,
        kubeconfig: str | None = None,
    ) -> None:
        # None: every InferenceService's server endpoints in the namespace (the namespace-wide
        # router); they carry the label the operator puts on each servers' headless Service.
        self.service = service
        self.label_selector = (f"kubernetes.io/service-name={service}" if service is not None
                               else SERVERS_ENDPOINTS_SELECTOR)
        self.namespace = namespace
        self.port_name = port_name
        self.kubeconfig = kubeconfig  # None: in-cluster, else $KUBECONFIG, else ~/.kube/config
        self._on_urls = on_urls
        self._loop = loop
        self._stop = threading.Event()
        self._slices: dict[str, list[str]] = {}
        self._published: list[str] | None = None
        self._watch: Watch | None = None
        self._thread = threading.Thread(target=self._run, name="endpointslice-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()  # ends the stream at its next event or server timeout

    def slice_urls(self, endpoint_slice: Any) -> list[str]:
        port = None
        for p in endpoint_slice.ports or []:
            # A port without a number means "unrestricted": nothing we could dial.
            if p.port is not None and (self.port_name is None or p.name == self.port_name):
                port = p.port
                break
        if port is None:
            return []
        urls = []
        for endpoint in endpoint_slice.endpoints or []:
            conditions = endpoint.conditions
            # The API says an unknown (unset) ready condition is to be read as ready.
            if conditions is not None and conditions.ready is False:
                continue
            if not endpoint.addresses:
                continue
            # An endpoint's addresses are fungible (one pod); routing to all would count it twice.
            urls.append(base_url(endpoint.addresses[0], port))
        return urls

    def _publish(self) -> None:
        urls = sorted({u for urls in self._slices.values() for u in urls})
        if urls == self._published:
            return
        self._published = urls
        self._loop.call_soon_threadsafe(self._on_urls, urls)

    def _run(self) -> None:
        from kubernetes import client, watch

        api = client.DiscoveryV1Api(kube_api_client(self.kubeconfig))
        selector = self.label_selector
        while not self._stop.is_set():
            try:
                listing = api.list_namespaced_endpoint_slice(
                    self.namespace, label_selector=selector, _request_timeout=K8S_TIMEOUT_S)
                self._slices = {_slice_name(s): self.slice_urls(s) for s in listing.items}
                self._publish()
                self._watch = watch.Watch()
                stream = self._watch.stream(
                    api.list_namespaced_endpoint_slice,
                    self.namespace,
                    label_selector=selector,
                    resource_version=listing.metadata.resource_version if listing.metadata else None,
                    timeout_seconds=WATCH_TIMEOUT_S,
                    _request_timeout=(K8S_TIMEOUT_S[0], WATCH_TIMEOUT_S + K8S_TIMEOUT_S[1]),
                )
                for event in stream:
                    if self._stop.is_set():
                        return
                    if event["type"] not in ("ADDED", "MODIFIED", "DELETED"):
                        continue  # bookmarks carry no endpoints
                    endpoint_slice = event["object"]
                    name = endpoint_slice.metadata.name
                    if event["type"] == "DELETED":
                        self._slices.pop(name, None)
                    else:
                        self._slices[name] = self.slice_urls(endpoint_slice)
                    self._publish()
            except Exception as exc:  # apiserver restarts, expired resourceVersion: relist
                if self._stop.is_set():
                    return
                log.warning("EndpointSlice watch for %s/%s: %s; relisting", self.namespace, self.service, exc)
                self._stop.wait(2.0)


def _slice_name(endpoint_slice: Any) -> str:
    # The API server names every object; the client's model types leave every field optional.
    metadata = endpoint_slice.metadata
    if metadata is None or metadata.name is None:
        raise ValueError("an EndpointSlice without a name")
    return str(metadata.name)
