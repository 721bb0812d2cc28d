"""LoRA adapters registered and forgotten while the engine runs: what the core does with the front
end's ``UpdateLoRA`` between two steps (docs/server.md, "Loading adapters at run time").

A load reads and checks the adapter as start-up does (server/worker/lora_manager.py); whatever is
wrong with it is the caller's, refused with why, and the engine and its requests go on. An unload
is refused while a request on the adapter is unfinished (running, waiting or preempted): the
front end answers 409 and the client unloads again once they are done.
"""

from __future__ import annotations

import logging
from itertools import chain
from typing import Any

logger = logging.getLogger(__name__)

# Why an update was refused: the request's fault (400), an unknown name (404), an adapter still in
# use (409), anything else (500).
INVALID, NOT_FOUND, BUSY, INTERNAL = "invalid", "not_found", "busy", "internal"


def update_lora(engine: Any, name: str, path: str | None) -> tuple[str, str] | None:
    """Register ``name`` at ``path`` (None: forget ``name``) in ``engine``; None, or (kind, why)."""
    lora = engine.runner.lora
    if lora is None:
        return INVALID, "LoRA adapters are off (--enable-lora)"
    if path is not None:
        return _load(lora, name, path)
    if name not in lora.paths:
        return NOT_FOUND, f"LoRA adapter {name!r} is not loaded"
    scheduler = engine.scheduler
    busy = sum(1 for seq in chain(scheduler.running, scheduler.waiting) if seq.request.lora_name == name)
    if busy:
        return BUSY, (f"LoRA adapter {name!r} serves {busy} unfinished sequence(s); unload it once "
                      "they are done")
    lora.remove(name)
    logger.info("LoRA adapter %r unloaded", name)
    return None


def _load(lora: Any, name: str, path: str) -> tuple[str, str] | None:
    try:
        lora.add(name, path)
    except (ValueError, OSError) as exc:
        return INVALID, str(exc)
    except MemoryError as exc:
        return INTERNAL, f"LoRA adapter {name!r}: out of memory ({exc})"
    except Exception as exc:  # noqa: BLE001 - a malformed file's reader error must not end the core
        if type(exc).__name__ == "OutOfMemoryError":  # torch's, on the device
            return INTERNAL, f"LoRA adapter {name!r}: out of device memory ({exc})"
        logger.warning("LoRA adapter %r (%s) refused: %s: %s", name, path, type(exc).__name__, exc)
        return INVALID, f"LoRA adapter {name!r} ({path}) could not be read: {type(exc).__name__}: {exc}"
    logger.info("LoRA adapter %r loaded from %s", name, path)
    return None
