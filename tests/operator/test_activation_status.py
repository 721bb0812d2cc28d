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
    assert fields == {"heldRequests": 0, "activationStarted": None, "lastColdStartSeconds": 7.5,
                      "lastColdStartTime": "2026-01-01T00:00:09Z"}
    assert event is not None and "7.5 s" in event
    # Without a router's measure: the time since the start.
    fields, _ = activation_status({"activationStarted": "2026-01-01T00:00:00Z"}, 1, 0,
                                  "2026-01-01T00:00:09Z", [])
    assert fields["lastColdStartSeconds"] == 9.0
    # Nothing held, nothing ready: no activation.
    assert activation_status({}, 0, 0, "2026-01-01T00:00:00Z", []) == ({"heldRequests": 0}, None)


def test_a_scale_from_zero_between_two_scrapes_is_recorded_once() -> None:
    """A router raised the scale itself and the replica was ready before any scrape saw requests
    held: the routers' report of a cold start that ended since the last one recorded is it."""
    ended = [(3.5, 2.0), (3.25, 1.0)]  # two routers saw the same replica ready a second apart
    fields, event = activation_status({}, 1, 0, "2026-01-01T00:10:00Z", [3.5, 3.25], ended)
    assert fields == {"heldRequests": 0, "lastColdStartSeconds": 3.5, "lastColdStartTime": "2026-01-01T00:10:00Z"}
    assert event is not None and "3.5 s" in event
    # The next scrape, 5 s later: the same cold start, now 7 and 6 s ago, is not a new one.
    recorded = {"lastColdStartSeconds": 3.5, "lastColdStartTime": "2026-01-01T00:10:00Z"}
    later = [(3.5, 7.0), (3.25, 6.0)]
    assert activation_status(recorded, 1, 0, "2026-01-01T00:10:05Z", [3.5, 3.25], later) == ({"heldRequests": 0}, None)
    # Scaled up by hand an hour later with no request held: the routers' old cold start stays old.
    old = [(3.5, 3605.0)]
    assert activation_status(recorded, 1, 0, "2026-01-01T01:10:00Z", [3.5], old) == ({"heldRequests": 0}, None)
    # The next scale from zero that also went by between scrapes is recorded.
    fields, event = activation_status(recorded, 1, 0, "2026-01-01T02:00:00Z", [9.0], [(9.0, 3.0)])
    assert fields["lastColdStartSeconds"] == 9.0 and event is not None
