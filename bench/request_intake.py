"""The front end's work on one structured request before it reaches the engine core: what the
compile storm's stall was made of (docs/server.md, "Measured and not kept"), old way and new way in
the same process, on the storm's own request body (``structured_outputs_serving.hard_schema``,
~190 KB, ``strict: true``).

- body parse: ``json.loads`` (Starlette's) against ``request_json.loads`` (msgspec, strict JSON);
- schema written out: ``json.dumps`` compact against ``request_json.dumps_compact``;
- ``close_objects``: the ``strict: true`` walk the front end ran on each request before, which
  now runs in the compile worker (0 ms on the event loop);
- ``_structured_outputs_from``: the whole step as the front end runs it now.

    python -m bench.request_intake     # bench/results/request_intake.json
"""

from __future__ import annotations

import argparse
import json
import time

from bench.common import machine, median_ms, write_result
from bench.structured_outputs_serving import hard_schema, json_schema_format
from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints import request_json
from kvscale.server.entrypoints.serving import _structured_outputs_from
from kvscale.server.structured_outputs.strict_schema import close_objects


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--branches", type=int, default=100, help="hard_schema's size, as the storm's")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    schema = hard_schema(7, args.branches)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "JSON"}], "max_tokens": 4,
                       "temperature": 0, "response_format": json_schema_format(schema)}).encode()
    request = p.ChatCompletionRequest.model_validate(request_json.loads(body))

    def timed(action) -> float:
        return median_ms(action, args.repeats, warmup=2)

    rows = {
        "parse_json_loads_ms": timed(lambda: json.loads(body)),
        "parse_msgspec_ms": timed(lambda: request_json.loads(body)),
        "write_json_dumps_ms": timed(lambda: json.dumps(schema, separators=(",", ":"), ensure_ascii=False)),
        "write_msgspec_ms": timed(lambda: request_json.dumps_compact(schema)),
        "close_objects_ms": timed(lambda: close_objects(schema)),
        "structured_outputs_from_now_ms": timed(lambda: _structured_outputs_from(request)),
    }
    before = rows["parse_json_loads_ms"] + rows["write_json_dumps_ms"] + rows["close_objects_ms"]
    after = rows["parse_msgspec_ms"] + rows["structured_outputs_from_now_ms"]
    result = {"benchmark": "request_intake", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": machine(), "body_bytes": len(body), "branches": args.branches, **rows,
              "front_end_before_ms": before, "front_end_after_ms": after, "before_over_after": before / after}
    for name, value in result.items():
        if name.endswith("_ms") or name == "before_over_after":
            print(f"{name:32s} {value:8.3f}")
    print(write_result("request_intake", result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
