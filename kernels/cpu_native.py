"""The CPU decode attention in C (``cpu_decode_attention.c``), built on first use and cached.

The engine's CPU decode step spends most of its non-GEMM time in the PyTorch reference's
per-sequence ops; this kernel reads the paged cache in place for every sequence of a layer in one
call. It is compiled with the machine's C compiler for the machine it runs on (``-march=native``)
into ``$KVSCALE_CACHE/native/`` under a name derived from the source, the flags and the compiler,
so a changed source or another CPU never loads a stale build, and concurrent processes each
rename a finished file into place. Where no compiler exists (a slim container image without a
prebuilt library) the reference is used, with one warning.

``KVSCALE_CPU_ATTENTION``: ``auto`` (default: the C kernel when it builds), ``native`` (the C
kernel or an error), ``reference`` (PyTorch ops only).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from kvscale.kernels import reference

logger = logging.getLogger(__name__)

SOURCE = "cpu_decode_attention.c"
# -ffast-math lets the exp loop call glibc's vector expf (libmvec); the dot products are
# reassociated either way (omp simd reductions), as every vectorised kernel's are.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-ffast-math") + (
    # gcc keeps to 256-bit vectors on AVX-512 Xeons unless told otherwise; the kernel's rows are
    # 512 bits, and the wider registers measured 1.3x faster here (float32, one thread).
    ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()
)
LDLIBS = ("-lmvec", "-lm")
MODES = ("auto", "native", "reference")
_BAD_TABLE = 2


class NativeKernelError(RuntimeError):
    """The C kernel was asked for (``KVSCALE_CPU_ATTENTION=native``) but cannot be built."""


def mode() -> str:
    value = os.environ.get("KVSCALE_CPU_ATTENTION", "auto")
    if value not in MODES:
        raise ValueError(f"KVSCALE_CPU_ATTENTION={value!r}: expected one of {', '.join(MODES)}")
    return value


def library_path(source: bytes, compiler_id: str, cache: Path) -> Path:
    """Where the build of this source with these flags and this compiler lives."""
    key = hashlib.sha256(source + " ".join(CFLAGS + LDLIBS).encode() + compiler_id.encode()).hexdigest()[:16]
    return cache / f"cpu_decode_attention-{key}.so"


def _native_cache() -> Path:
    from kvscale.server.model_loader import cache_root

    return cache_root() / "native"


def build(cache: Path | None = None) -> Path:
    """Compile the kernel unless this exact build is cached; the path of the shared library."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise NativeKernelError("no C compiler (cc or $CC) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    source = resources.files("kvscale.kernels").joinpath(SOURCE).read_bytes()
    cache = cache or _native_cache()
    target = library_path(source, version.stdout, cache)
    if target.exists():
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix=".build-", dir=cache))
    except OSError:  # a read-only cache (e.g. in an image): build beside the process instead
        workdir = Path(tempfile.mkdtemp(prefix="kvscale-native-"))
        target = workdir / target.name
    src = workdir / SOURCE
    src.write_bytes(source)
    built = workdir / target.name
    result = subprocess.run(
        [compiler, *CFLAGS, "-o", str(built), str(src), *LDLIBS], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise NativeKernelError(f"{compiler} failed:\n{result.stderr.strip()}")
    os.replace(built, target)
    if workdir != target.parent:
        shutil.rmtree(workdir, ignore_errors=True)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    wanted = mode()
    if wanted == "reference":
        return None
    try:
        # torch is imported above, so its libgomp.so.1 is already loaded and the kernel's
        # OpenMP calls resolve to it: one thread pool for torch's ops and ours.
        lib = ctypes.CDLL(str(build()))
    except (NativeKernelError, OSError) as exc:
        if wanted == "native":
            raise NativeKernelError(f"the C decode attention is unavailable: {exc}") from exc
        logger.warning("C decode attention unavailable (%s); using the PyTorch reference", exc)
        return None
    fn = lib.kvscale_paged_decode_attention
    c = ctypes
    fn.argtypes = [
        c.c_void_p, c.c_void_p, c.c_void_p, c.c_int, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p,
        c.c_int, c.c_int, c.c_int, c.c_int, c.c_int, c.c_float, c.c_void_p, c.c_int,
    ]
    fn.restype = c.c_int
    return lib


def available() -> bool:
    """Whether CPU decode attention runs in C in this process."""
    return _library() is not None


def paged_decode_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
) -> Tensor:
    """Same contract as :func:`kvscale.kernels.reference.paged_decode_attention`."""
    lib = _library()
    head_dim = query.shape[-1]
    if (lib is None or k_cache.dtype not in (torch.float32, torch.bfloat16) or query.is_cuda
            or head_dim % 16 or head_dim > 128):
        return reference.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)
    reference.check_cache(k_cache, v_cache)
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    reference.check_heads(num_heads, num_kv_heads)
    if cache_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} does not match the cache's {cache_head_dim}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(
            f"block_tables must be [{num_seqs}, max_blocks] and context_lens [{num_seqs}], got "
            f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}"
        )
    q = query.to(torch.float32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    status = lib.kvscale_paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16),
        num_blocks, tables.data_ptr(), tables.shape[1], lens.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, out.data_ptr(),
        torch.get_num_threads(),
    )
    if status == _BAD_TABLE:
        raise ValueError(
            "a context needs more blocks than its block table row holds, or a used entry is not a "
            f"block of the {num_blocks}-block cache"
        )
    if status:
        raise MemoryError("decode attention could not allocate its score buffers")
    return out.to(query.dtype)
