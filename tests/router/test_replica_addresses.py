"""Replicas found by address (EndpointSlices, --replicas) matched with the base URL their
heartbeats carry, whatever the spelling of the address."""

from __future__ import annotations

import pytest

from kvscale.router.replicas import ReplicaSet


@pytest.mark.parametrize("discovered, advertised", [
    ("http://[fd00::5]:8000", "http://[fd00:0:0::5]:8000"),
    ("http://[FD00::5]:8000/v1", "http://[fd00::5]:8000"),
    ("10.1.2.3:8000", "http://10.1.2.3:8000/"),
])
def test_a_heartbeat_binds_the_replica_it_describes(discovered, advertised):
    replicas = ReplicaSet()
    replicas.set_urls([discovered])
    replicas.bind_heartbeat_ids({advertised: "pod-a"})
    assert [r.replica_id for r in replicas.replicas.values()] == ["pod-a"]


def test_a_replica_without_a_heartbeat_gets_the_id_kvscale_serve_would_give_it():
    replicas = ReplicaSet()
    replicas.set_urls(["http://[fd00:0::5]:8000"])
    assert [r.replica_id for r in replicas.replicas.values()] == ["[fd00::5]:8000"]
