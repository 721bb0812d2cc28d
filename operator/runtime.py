"""What the handlers share, kept in kopf's memo: the API client, the configuration, the
autoscalers' state, the watched InferenceServices, one lock per InferenceService and whether
LeaderWorkerSets are served (multi_node.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvscale.operator import scaling
from kvscale.operator.config import OperatorConfig
from kvscale.operator.inference_service import ObjectKey
from kvscale.operator.kube import Kube
from kvscale.operator.metrics import OperatorMetrics
from kvscale.operator.multi_node import LeaderWorkerSetDiscovery


@dataclass
class Runtime:
    kube: Kube
    config: OperatorConfig
    autoscalers: dict[str, scaling.AutoscalerState] = field(default_factory=dict)  # by uid
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    watched: dict[str, ObjectKey] = field(default_factory=dict)  # by uid
    last_runs: dict[str, dict[str, float]] = field(default_factory=dict)  # work -> uid -> when
    in_flight: dict[str, dict[str, float]] = field(default_factory=dict)  # work -> uid -> since
    rounds: dict[str, float] = field(default_factory=dict)  # work -> its loop's last round
    lws: LeaderWorkerSetDiscovery = field(default_factory=LeaderWorkerSetDiscovery)
    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _locks_guard: threading.Lock = field(default_factory=threading.Lock)

    def lock(self, uid: str) -> threading.Lock:
        """Held while handling one InferenceService: the periodic loop and a watch event of the
        same object may otherwise write its status at once."""
        with self._locks_guard:
            return self._locks.setdefault(uid, threading.Lock())

    def forget(self, uid: str) -> None:
        self.watched.pop(uid, None)
        for runs in self.last_runs.values():
            runs.pop(uid, None)
        # in_flight is not touched: a run still going removes itself when it ends.
        with self._locks_guard:
            self._locks.pop(uid, None)
        self.autoscalers.pop(uid, None)
        self.metrics.forget(uid)
