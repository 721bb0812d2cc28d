"""glibc's allocator told to keep big freed blocks, so a step's activations reuse warm pages."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def keep_freed_memory_for_reuse() -> bool:
    """Stop glibc from handing big freed blocks back to the kernel (once per process).

    Every step allocates the same multi-megabyte activations and gathered K/V again; above
    glibc's mmap threshold each one is a fresh mapping whose pages fault in on first touch,
    which on CPU made a decode step's K/V gather ~3x slower than the copy itself.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl, macOS): nothing to tune
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    # The mmap threshold is capped at 32 MiB on 64-bit glibc; larger buffers stay mmapped.
    return bool(mallopt(m_mmap_threshold, 32 * 1024 * 1024)) and bool(mallopt(m_trim_threshold, 1 << 30))
