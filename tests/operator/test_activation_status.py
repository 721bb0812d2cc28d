"""A scale from zero in the status: started when requests are held with no ready replica, ended
with the cold start at the first ready replica (operator/autoscale.py's activation_status)."""

from __future__ import annotations

from kvscale.operator.autoscale import activation_status


def test_an_activation_starts_with_held_requests_and_ends_with_the_cold_start() -> None:
    fields, event = activation_status({}, ready=0, held=3, now_text="2026-01-01T00:00:00Z",
                                      cold_starts=[])
    assert fields == {"heldRequests": 3, "activationStarted": "2026-01-01T00:00:00Z"} and event is None
    # Still coming: the start stays as it was.
    fields, event = activation_status({"activationStarted": "2026-01-01T00:00:00Z"}, 0, 5,
                                      "2026-01-01T00:00:04Z", [])
    assert "activationStarted" not in fields and event is None
    # Ready: the routers' own measure wins; the start is cleared (a merge patch's null).
    fields, event = activation_status({"activationStarted": "2026-01-01T00:00:00Z"}, 1, 0,
                                      "2026-01-01T00:00:09Z", [6.25, 7.5])
    assert fields == {"heldRequests": 0, "activationStarted": None, "lastColdStartSeconds": 7.5}
    assert event is not None and "7.5 s" in event
    # Without a router's measure: the time since the start.
    fields, _ = activation_status({"activationStarted": "2026-01-01T00:00:00Z"}, 1, 0,
                                  "2026-01-01T00:00:09Z", [])
    assert fields["lastColdStartSeconds"] == 9.0
    # Nothing held, nothing ready: no activation.
    assert activation_status({}, 0, 0, "2026-01-01T00:00:00Z", []) == ({"heldRequests": 0}, None)
