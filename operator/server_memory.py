"""How a CPU server's memory limit is shared out: the processes of `kvscale serve`, then the KV cache.

On CPU the KV cache is ordinary memory with a fixed budget (`--kv-cache-memory-bytes`, 2 GiB
unless told), so the operator derives it from the container's memory limit. The limit covers
every process of the pod: the HTTP front end (tokenizer, no torch) and the engine core (torch,
weights, KV cache, activations). What the two hold before any weights is set aside first; the KV
cache gets a share of the rest, and the rest of that holds the weights and the activations.
"""

from __future__ import annotations

MIB = 2**20
GIB = 2**30

# What the two processes of `kvscale serve` hold besides weights, KV cache and activations,
# measured with the bundled model (VmHWM, docs/deploy.md "Server memory"): the front end peaks at
# 147 MiB, the engine core holds about 875 MiB besides its weights and KV cache (Python, torch, tokenizer, grammar
# library). Rounded up: the same 1 GiB for any model.
SERVER_PROCESSES_BYTES = 1 * GIB
# The KV cache's share of what the processes leave; the rest holds the weights and activations.
# 8Gi (the default) gives 1.75 GiB, 2Gi gives 256 MiB.
CPU_KV_CACHE_SHARE = 0.25
# Below this, after the processes, no model can be loaded with any KV cache: the operator refuses
# the spec rather than render a pod that is OOMKilled in a loop.
MIN_LEFT_BYTES = 512 * MIB

_QUANTITY_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
                   "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity ("2Gi", "512Mi", "1G", "1e9", "2147483648") in bytes."""
    text = quantity.strip()
    unit = next((u for u in sorted(_QUANTITY_UNITS, key=len, reverse=True) if u and text.endswith(u)), "")
    number = text[: len(text) - len(unit)] if unit else text
    try:
        return int(float(number) * _QUANTITY_UNITS[unit])
    except ValueError as exc:
        raise ValueError(f"resources.memory {quantity!r} is not a Kubernetes quantity") from exc


def cpu_kv_cache_bytes(memory: str) -> int:
    """The KV cache budget of a CPU server whose container is limited to ``memory``; ValueError
    when the limit leaves the model no room once both processes are counted."""
    limit = quantity_bytes(memory)
    left = limit - SERVER_PROCESSES_BYTES
    if left < MIN_LEFT_BYTES:
        raise ValueError(
            f"resources.memory {memory} is too small for a CPU server: its two processes (HTTP "
            f"front end and engine core) take {SERVER_PROCESSES_BYTES // MIB} MiB before the "
            f"weights, leaving {max(left, 0) // MIB} MiB for weights and KV cache; give it at "
            f"least {(SERVER_PROCESSES_BYTES + MIN_LEFT_BYTES) // MIB}Mi (8Gi by default)")
    return int(left * CPU_KV_CACHE_SHARE)
