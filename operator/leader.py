"""Leader election on a coordination.k8s.io Lease, the way client-go does it.

Only the holder reconciles, so two operator replicas never fight over the same objects. Expiry is
judged by this process's own clock from when it last saw the record change, never by comparing
clocks across machines. A holder that cannot renew within the renew deadline stops (the caller
exits); one that stops cleanly releases the Lease so a standby takes over at once.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvscale.operator.kube import ApiError, Kube, path_for

logger = logging.getLogger("kvscale.operator.leader")


def _micro_time(moment: float) -> str:
    return dt.datetime.fromtimestamp(moment, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class LeaderElector:
    kube: Kube
    namespace: str
    name: str
    identity: str
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    _observed_record: tuple | None = field(default=None, init=False)
    _observed_at: float = field(default=0.0, init=False)

    @property
    def lease_path(self) -> str:
        return path_for("coordination.k8s.io/v1", "leases", self.namespace, self.name)

    def try_acquire_or_renew(self) -> bool:
        now = time.time()
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.lease_duration)),
            "renewTime": _micro_time(now),
        }
        lease = self.kube.get(self.lease_path)
        if lease is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": {**spec, "acquireTime": _micro_time(now), "leaseTransitions": 0}}
            try:
                self.kube.create(path_for("coordination.k8s.io/v1", "leases", self.namespace), body)
            except ApiError as exc:
                if exc.status == 409:
                    return False
                raise
            return True

        current = lease.get("spec") or {}
        holder = current.get("holderIdentity") or ""
        record = (holder, current.get("renewTime"), current.get("leaseDurationSeconds"))
        if record != self._observed_record:
            self._observed_record, self._observed_at = record, time.monotonic()
        duration = float(current.get("leaseDurationSeconds") or self.lease_duration)
        expired = time.monotonic() > self._observed_at + duration
        if holder and holder != self.identity and not expired:
            return False

        new_spec = {**current, **spec}
        if holder != self.identity:
            new_spec["acquireTime"] = _micro_time(now)
            new_spec["leaseTransitions"] = int(current.get("leaseTransitions") or 0) + 1
        lease["spec"] = new_spec
        try:
            self.kube.replace(self.lease_path, lease)  # resourceVersion guards against a race
        except ApiError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def acquire(self, stop: threading.Event, on_attempt: Callable[[], None] = lambda: None) -> bool:
        """Block until this process leads (True) or `stop` is set (False); `on_attempt` is told
        of every try (the liveness heartbeat of a standby)."""
        announced = False
        while not stop.is_set():
            on_attempt()
            try:
                if self.try_acquire_or_renew():
                    logger.info("became the leader (lease %s/%s)", self.namespace, self.name)
                    return True
            except (ApiError, OSError) as exc:
                logger.warning("leader election: %s", exc)
            if not announced:
                logger.info("waiting to lead: lease %s/%s is held by %s", self.namespace,
                            self.name, (self._observed_record or ("?",))[0])
                announced = True
            stop.wait(self.retry_period)
        return False

    def hold(self, stop: threading.Event) -> bool:
        """Renew until `stop` is set (True) or the lease is lost (False)."""
        last_renewal = time.monotonic()
        while not stop.wait(self.retry_period):
            try:
                if self.try_acquire_or_renew():
                    last_renewal = time.monotonic()
                    continue
                logger.error("lost the lease to %s", (self._observed_record or ("?",))[0])
                return False
            except Exception as exc:  # a renewal that fails for any reason counts as not renewed
                logger.warning("lease renewal failed: %s", exc)
            if time.monotonic() - last_renewal > self.renew_deadline:
                logger.error("could not renew the lease within %.0fs", self.renew_deadline)
                return False
        return True

    def release(self) -> None:
        try:
            lease = self.kube.get(self.lease_path)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = ""
                lease["spec"]["leaseDurationSeconds"] = 1
                self.kube.replace(self.lease_path, lease)
                logger.info("released the lease")
        except (ApiError, OSError) as exc:
            logger.warning("could not release the lease: %s", exc)
