"""A meter for the memory a piece of work adds at its peak (used by the profiling pass).

CUDA: torch's allocator peak (``reset_peak_memory_stats`` / ``max_memory_allocated``) above what
was allocated when the meter started, plus memory the device gained outside torch's allocator
meanwhile (cuBLAS workspaces, loaded kernels: ``mem_get_info`` minus what torch reserves).

CPU: the process's resident-set high-water mark: reset to the current RSS by writing "5" to
/proc/self/clear_refs, read back as VmHWM from /proc/self/status. Memory the allocator holds
free is handed back first (``malloc_trim``), so the pass has to fault in what it needs and the
mark shows it, instead of reusing pages an earlier step left resident.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from pathlib import Path

import torch

_PROC_SELF = Path("/proc/self")


class MemoryMeter:
    """``with MemoryMeter(device) as meter: work()`` then ``meter.peak_bytes`` (None: cannot
    measure here, e.g. no /proc). ``used_before`` / ``total`` are device-wide on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes: int | None = None
        self.used_before = 0
        self.total = 0
        self._allocated_before = 0
        self._non_torch_before = 0
        self._rss_before: int | None = None

    def __enter__(self) -> MemoryMeter:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            free, self.total = torch.cuda.mem_get_info(self.device)
            self.used_before = self.total - free
            self._allocated_before = torch.cuda.memory_allocated(self.device)
            self._non_torch_before = self.used_before - torch.cuda.memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            malloc_trim()
            self._rss_before = reset_rss_peak()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch_peak = torch.cuda.max_memory_allocated(self.device) - self._allocated_before
            free, total = torch.cuda.mem_get_info(self.device)
            non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
            self.peak_bytes = torch_peak + max(0, non_torch - self._non_torch_before)
        elif self._rss_before is not None:
            peak = read_status_bytes("VmHWM")
            self.peak_bytes = None if peak is None else max(0, peak - self._rss_before)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(bytes in use, total bytes) of a CUDA device, after torch hands back its free cache."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free, total


def reset_rss_peak() -> int | None:
    """Reset this process's RSS high-water mark to its current RSS; that RSS in bytes, or None
    where the kernel offers no reset (not Linux, or /proc/self/clear_refs not writable)."""
    try:
        (_PROC_SELF / "clear_refs").write_text("5")
    except OSError:
        return None
    return read_status_bytes("VmRSS")


def read_status_bytes(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    try:
        lines = (_PROC_SELF / "status").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024
    return None


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def malloc_trim() -> None:
    """Hand the memory glibc's allocator holds free back to the kernel (freed tensors below
    its mmap threshold stay resident, and count against a pod's memory limit, until then)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:  # glibc only
        trim(0)
