"""A path the router has no route for is a 404 in OpenAI's error body, so clients parse it as
theirs (docs/router.md)."""

from __future__ import annotations

import httpx

from kvscale.router.config import RouterConfig


def test_unknown_paths_are_openai_404s(in_process_routers) -> None:
    # No replica behind it: the 404 is the router's own answer, before any routing.
    url = in_process_routers.start(RouterConfig(replicas=[], policy="round-robin", models=[]))
    for method, path in (("POST", "/v1/responses/resp_1/cancel"), ("GET", "/v1/responses/resp_1/input_items"),
                         ("GET", "/v1/nope")):
        response = httpx.request(method, f"{url}{path}", json={} if method == "POST" else None, timeout=10)
        assert response.status_code == 404
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "not_found"
        assert path in error["message"]
