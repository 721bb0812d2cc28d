"""``kvscale serve --kv-events-config JSON``: vLLM's KVEventsConfig, in its spelling and JSON.

Parsed in the front end (a bad value is refused at start, exit code 2, like every flag) and
handed to the engine core process, which runs the publisher (kv_events_vllm.py). The fields
and their defaults are vLLM's; docs/engine.md "KV events for llm-d and Dynamo".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from kvscale.server.json_object import parse_json_object

PUBLISHERS = ("null", "zmq")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" when events are enabled and no publisher is named (as vLLM)
    endpoint: str = "tcp://*:5557"  # a wildcard, ipc:// or inproc:// binds; any other connects
    replay_endpoint: str | None = None  # a ROUTER socket replaying the last buffer_steps batches
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def _check_type(name: str, value: Any, kind: type | tuple[type, ...]) -> None:
    # bool is an int to isinstance; vLLM's pydantic refuses true for a count, so do we.
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        words = {bool: "true or false", int: "an integer", str: "a string"}
        wanted = " or ".join(words[k] for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ValueError(f"{name} must be {wanted}, got {json.dumps(value)}")


def _check_endpoint(name: str, value: str) -> None:
    if not value.startswith(ENDPOINT_SCHEMES):
        raise ValueError(f"{name} must start with {', '.join(ENDPOINT_SCHEMES)}, got {value!r}")
    if value.startswith("tcp://"):
        _, _, port = value.rpartition(":")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{name} needs a port (tcp://HOST:PORT), got {value!r}")


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """A JSON object of KVEventsConfig's fields; ValueError naming what is wrong."""
    raw = parse_json_object(text)
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    types: dict[str, type | tuple[type, ...]] = {
        "enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "replay_endpoint": str,
        "buffer_steps": int, "hwm": int, "max_queue_size": int, "topic": str}
    for name, value in raw.items():
        if not (name == "replay_endpoint" and value is None):
            _check_type(name, value, types[name])
    if raw.get("publisher") is None:
        raw["publisher"] = "zmq" if raw.get("enable_kv_cache_events") else "null"
    config = KVEventsConfig(**raw)
    if config.publisher not in PUBLISHERS:
        raise ValueError(f"publisher must be one of {', '.join(PUBLISHERS)}, got {config.publisher!r}")
    _check_endpoint("endpoint", config.endpoint)
    if config.replay_endpoint is not None:
        _check_endpoint("replay_endpoint", config.replay_endpoint)
        if config.replay_endpoint == config.endpoint:
            raise ValueError("replay_endpoint must differ from endpoint")
    for name in ("buffer_steps", "max_queue_size"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(config, name)}")
    if config.hwm < 0:
        raise ValueError(f"hwm must be non-negative (0: no limit), got {config.hwm}")
    return config


def kv_events_config_argument(text: str) -> KVEventsConfig:
    """argparse's ``type`` for --kv-events-config: a bad value is argparse's error, exit code 2."""
    import argparse

    try:
        return parse_kv_events_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--kv-events-config: {exc}") from exc
