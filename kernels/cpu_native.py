"""The engine's C kernels for CPUs (built on first use and cached), their Python entry points,
and the CPU kernel backend (``CPU``: C decode attention, C prefill attention on AMX and AVX2 CPUs, the
PyTorch references for the rest).

``cpu_decode_attention.c``: decode attention reading the paged cache in place for every sequence
of a layer in one call (the PyTorch reference's per-sequence ops were most of a decode step's
non-GEMM time); a bfloat16 or FP8 cache on AMX tiles where the CPU has them. ``cpu_write_kv.c``: the new tokens' K/V rows into their cache slots.
``cpu_prefill_attention.c``: bfloat16 prefill attention on AMX tiles over the paged cache, every
sequence of a layer in one call; ``cpu_prefill_attention_f32.c`` the same in float32 on AVX2 and FMA. ``cpu_linear_amx.c``: bfloat16 and int8 projections on AMX tiles,
the weight laid out once in the order the kernel streams it. ``cpu_linear_narrow.c``: bfloat16 or
int8 weights on a decode step's few float32 rows where the CPU has no bf16 or int8 dot products,
each weight widened as it is read. ``cpu_token_mask.c``: a structured
output step's token bitmask applied to its logits rows in place. ``cpu_layer_ops.c``: the decoder layer's elementwise steps
(SiLU-and-multiply, residual add + RMSNorm, RoPE) fused into one pass each. ``cpu_threads.c``: pins the OpenMP
pool torch and these kernels share, one thread per CPU (``bind_threads``).

Both are compiled into one library by the machine's C compiler for the machine it runs on
(``-march=native``), into ``$KVSCALE_CACHE/native/`` (or ``$TMPDIR/kvscale-native-UID/`` when
that is read-only, as in the engine image) under a name derived from the sources, the flags, the
compiler and the CPU it targets, so a changed source or another CPU never loads a stale build;
concurrent processes each rename a finished file into place. A folder another user owns or may
write to is never read (a library planted there would run in this process). Where no compiler exists PyTorch ops are used, with one
warning; every entry point returns None (or runs the reference) for what it does not take.

``KVSCALE_CPU_KERNELS``: ``auto`` (default: the C kernels when they build), ``native`` (the C
kernels or an error), ``reference`` (PyTorch ops only).
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

from kvscale.kernels import fp8, reference
from kvscale.kernels.ops import KernelBackend

logger = logging.getLogger(__name__)

SOURCES = ("cpu_decode_attention.c", "cpu_prefill_attention.c", "cpu_prefill_attention_f32.c", "cpu_write_kv.c",
           "cpu_layer_ops.c", "cpu_quantize.c", "cpu_linear_amx.c", "cpu_token_mask.c", "cpu_threads.c",
           "cpu_step_layers.c", "cpu_linear_narrow.c")
HEADERS = ("cpu_amx.h", "cpu_silu.h", "cpu_softmax.h")  # included by the sources above: copied beside them, and part of the build's key
# -ffast-math lets the exp loop call glibc's vector expf (libmvec); the dot products are
# reassociated either way (omp simd reductions), as every vectorised kernel's are. It is a
# compile flag only: linked with it, gcc adds crtfastmath.o, which switches the whole process to
# flush-to-zero at load (torch's and Python's arithmetic would lose every subnormal).
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=gnu11", "-ffast-math") + (
    # gcc keeps to 256-bit vectors on AVX-512 Xeons unless told otherwise; the kernel's vector
    # rows are 512 bits, so each would otherwise be split in two.
    ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()
)
# Flags for one file on top of CFLAGS (cpu_quantize.c and cpu_write_kv.c say why).
FILE_CFLAGS = {"cpu_quantize.c": ("-fno-unsafe-math-optimizations",), "cpu_write_kv.c": ("-fno-fast-math",),
               # It writes -inf: -ffast-math's finite-math-only would let the compiler assume none.
               "cpu_token_mask.c": ("-fno-fast-math",)}
LDFLAGS = ("-shared", "-fopenmp")
LDLIBS = ("-lmvec", "-lm")
MODES = ("auto", "native", "reference")
# KVSCALE_BAD_TABLE in cpu_decode_attention.c, KVSCALE_PREFILL_BAD_TABLE and KVSCALE_PREFILL_F32_BAD_TABLE in
# the prefill kernels.
_BAD_TABLE = 2

_PTR, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# The C prototypes as ctypes sees them, (result, arguments): the one place the Python side
# writes them; the argument names are the C sources'.
_C_PROTOTYPES: dict[str, tuple[type | None, list[type]]] = {
    "kvscale_paged_decode_attention": (ctypes.c_int, [
        _PTR, _PTR, _PTR, _I32, _I32,  # query, k_cache, v_cache, cache_format, query_is_bf16
        _I64, _PTR, _I64, _PTR,  # num_blocks, block_tables, table_stride, context_lens
        _I32, _I32, _I32, _I32, _I32,  # num_seqs, num_heads, num_kv_heads, head_dim, block_size
        _F32, _F32, _F32, _PTR, _I32, _I32,  # scale, k_scale, v_scale, out, io_bf16, num_threads
    ]),
    # cache_format, query_is_bf16, block_size, num_heads, num_kv_heads, head_dim
    "kvscale_decode_attention_on_amx": (ctypes.c_int, [_I32, _I32, _I32, _I32, _I32, _I32]),
    "kvscale_paged_prefill_attention": (ctypes.c_int, [
        _PTR, _I64, _PTR, _PTR, _I64,  # query, query_stride, k_cache, v_cache, num_blocks
        _PTR, _I64, _PTR, _PTR,  # block_tables, table_stride, query_start_loc, context_lens
        _I32, _I32, _I32, _I32, _I32,  # num_seqs, num_heads, num_kv_heads, head_dim, block_size
        _I32, _F32, _F32, _F32, _PTR, _I32,  # cache_format, k_scale, v_scale, scale, out, num_threads
    ]),
    "kvscale_prefill_attention_available": (ctypes.c_int, []),
    "kvscale_paged_prefill_attention_f32": (ctypes.c_int, [
        _PTR, _I64, _PTR, _PTR, _I64,  # query, query_stride, k_cache, v_cache, num_blocks
        _PTR, _I64, _PTR, _PTR,  # block_tables, table_stride, query_start_loc, context_lens
        _I32, _I32, _I32, _I32, _I32,  # num_seqs, num_heads, num_kv_heads, head_dim, block_size
        _F32, _PTR, _I32,  # scale, out, num_threads
    ]),
    "kvscale_prefill_attention_f32_available": (ctypes.c_int, []),
    # x, rows, x_stride, w, int8_codes, n_out, k_in, out, num_threads
    "kvscale_linear_narrow": (ctypes.c_int, [_PTR, _I64, _I64, _PTR, _I32, _I64, _I64, _PTR, _I32]),
    "kvscale_linear_narrow_available": (ctypes.c_int, []),
    # key, key_stride, value, value_stride, k_cache, v_cache, num_slots, slots, num_tokens, row, elem
    "kvscale_write_kv": (ctypes.c_int, [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64]),
    # key, key_stride, value, value_stride, k_cache, v_cache, num_slots, slots, num_tokens, row, is_bf16,
    # format, k_scale, v_scale
    "kvscale_write_kv_fp8": (ctypes.c_int, [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I32, _I32,
                                            _F32, _F32]),
    # gate_up, out, rows, width, is_bf16, num_threads
    "kvscale_silu_and_mul": (None, [_PTR, _PTR, _I64, _I64, _I32, _I32]),
    # x, residual, weight, out, rows, width, eps, is_bf16, num_threads
    "kvscale_add_rms_norm": (None, [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _I32, _I32]),
    # x, row_stride, positions, cos_table, sin_table, table_stride, out, tokens, heads, head_dim,
    # is_bf16, num_threads
    "kvscale_rope": (None, [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I32, _I32]),
    # x, rows, width, is_bf16, q, scales, num_threads
    "kvscale_quantize_rows_u8": (None, [_PTR, _I64, _I64, _I32, _PTR, _PTR, _I32]),
    # y, y_bf16, scales, bias, rows, width, out, out_bf16, num_threads
    "kvscale_rescale_rows": (None, [_PTR, _I32, _PTR, _PTR, _I64, _I64, _PTR, _I32, _I32]),
    "kvscale_linear_amx_available": (ctypes.c_int, []),
    # weight, n, k, packed
    "kvscale_linear_amx_pack": (None, [_PTR, _I64, _I64, _PTR]),
    # x, x_stride, packed, bias, m, n, k, out, silu_mul, num_threads
    "kvscale_linear_amx": (ctypes.c_int, [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I32, _I32]),
    # weight, n, k, packed, column_sums
    "kvscale_linear_amx_int8_pack": (None, [_PTR, _I64, _I64, _PTR, _PTR]),
    # x, x_scales, packed, column_sums, w_scales, bias, m, n, k, out, out_bf16, silu_mul, num_threads
    "kvscale_linear_amx_int8": (ctypes.c_int, [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I32, _I32,
                                               _I32]),
    # logits, row_stride, is_bf16, rows, num_rows, bitmask, words, vocab, num_threads
    "kvscale_apply_token_bitmask": (None, [_PTR, _I64, _I32, _PTR, _I64, _PTR, _I64, _I64, _I32]),
    # cpus, num_threads
    "kvscale_bind_threads": (ctypes.c_int, [_PTR, _I32]),
    # layers, num_layers, shape, hidden, residual, rows, positions, cos_table, sin_table, cos_stride,
    # slots, attention, num_threads
    "kvscale_step_layers": (ctypes.c_int, [_PTR, _I32, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64,
                                             _PTR, _PTR, _I32]),
}


class Projection(ctypes.Structure):
    """cpu_step_layers.c's ``kvscale_projection``: one projection as the AMX kernel holds it
    (bfloat16 where ``w_scales`` is NULL, else int8)."""

    _fields_ = [("packed", _PTR), ("column_sums", _PTR), ("w_scales", _PTR), ("bias", _PTR),
                ("out_features", _I64), ("in_features", _I64)]


class DecoderLayer(ctypes.Structure):
    """cpu_step_layers.c's ``kvscale_decoder_layer``."""

    _fields_ = [("input_norm", _PTR), ("post_norm", _PTR), ("qkv", Projection), ("o", Projection),
                ("gate_up", Projection), ("down", Projection), ("k_cache", _PTR), ("v_cache", _PTR),
                ("k_scale", _F32), ("v_scale", _F32)]


class StepAttention(ctypes.Structure):
    """cpu_step_layers.c's ``kvscale_step_attention``: a decode step's tables and lengths (one
    sequence a row, ``query_start_loc`` NULL), or a step with prompt chunks and its single-token
    sequences apart."""

    _fields_ = [("block_tables", _PTR), ("table_stride", _I64), ("context_lens", _PTR), ("query_start_loc", _PTR),
                ("num_seqs", _I64), ("single_rows", _PTR), ("single_tables", _PTR), ("single_lens", _PTR),
                ("num_single", _I64)]


class DecoderShape(ctypes.Structure):
    """cpu_step_layers.c's ``kvscale_decoder_shape``."""

    _fields_ = [("hidden", _I64), ("intermediate", _I64), ("num_heads", ctypes.c_int32),
                ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("eps", _F32), ("scale", _F32),
                ("cache_format", ctypes.c_int32), ("block_size", ctypes.c_int32), ("num_blocks", _I64)]


class NativeKernelError(RuntimeError):
    """The C kernels were asked for (``KVSCALE_CPU_KERNELS=native``) but cannot be built."""


def mode() -> str:
    value = os.environ.get("KVSCALE_CPU_KERNELS", "auto")
    if value not in MODES:
        raise ValueError(f"KVSCALE_CPU_KERNELS={value!r}: expected one of {', '.join(MODES)}")
    return value


def library_path(source: bytes, compiler_id: str, target: str, cache: Path) -> Path:
    """Where the build of these sources, with these flags, by this compiler, for this CPU lives."""
    per_file = "".join(f"{name}:{' '.join(flags)}" for name, flags in sorted(FILE_CFLAGS.items()))
    key = hashlib.sha256(source + " ".join(CFLAGS + LDFLAGS + LDLIBS).encode() + per_file.encode() + compiler_id.encode()
                         + target.encode()).hexdigest()[:16]
    return cache / f"kvscale_cpu-{key}.so"


def source_bytes() -> bytes:
    return b"".join(resources.files("kvscale.kernels").joinpath(name).read_bytes() for name in SOURCES + HEADERS)


def compiler_id(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout


@functools.cache
def target_of(compiler: str) -> str:
    """What ``-march=native`` means on this machine, as the compiler resolves it: the -march,
    -m feature flags and cache --params gcc passes to cc1 (clang: its target CPU and features).
    Two machines with different instruction sets get different builds even in one shared cache."""
    driver = subprocess.run([compiler, "-march=native", "-###", "-x", "c", "-c", os.devnull, "-o", os.devnull],
                            capture_output=True, text=True, check=False)
    tokens = [t.strip('"') for t in (driver.stderr + driver.stdout).split()]
    kept = [t for i, t in enumerate(tokens)
            if t.startswith(("-m", "--param")) or (i and tokens[i - 1] in ("-target-cpu", "-target-feature"))]
    # A compiler that says nothing of the target: the kernel's own view of the CPU instead.
    return " ".join(kept) or _cpu_flags()


def _cpu_flags() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), info[:4096])


def _native_cache() -> Path:
    from kvscale.model_files import cache_root

    return cache_root() / "native"


def _private_tmp() -> Path:
    """This user's folder for builds under the temporary directory (a pod's /tmp emptyDir)."""
    return Path(tempfile.gettempdir()) / f"kvscale-native-{os.geteuid()}"


def untrusted(directory: Path) -> str | None:
    """Why a library in ``directory`` could be someone else's (None: only this user can have put
    it there). A folder others may write to, or that another user owns, could hold a planted
    library under the very name this build looks for, and loading it runs its code."""
    try:
        info = directory.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None  # made below with mode 0700, or unusable (and then passed over)
    if info.st_uid != os.geteuid():
        return f"owned by uid {info.st_uid}, not {os.geteuid()}"
    if info.st_mode & 0o022:
        return f"writable by others (mode {info.st_mode & 0o777:o})"
    return None


def _trusted_library(target: Path) -> bool:
    info = target.stat()
    return info.st_uid == os.geteuid() and not info.st_mode & 0o022


def build(cache: Path | None = None) -> Path:
    """Compile the kernels unless this exact build is cached; the path of the shared library.

    Only folders this user alone controls are read or written: a folder another user owns or
    may write to is refused (with a warning) and the build goes to a fresh private folder.
    """
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise NativeKernelError("no C compiler (cc or $CC) on PATH")
    source, version, target_cpu = source_bytes(), compiler_id(compiler), target_of(compiler)
    # A read-only cache (the image's, where the bundled model lives) is read, and builds go to
    # the temporary directory (a pod's /tmp emptyDir), where later processes find them too.
    directories = []
    for directory in (cache or _native_cache(), _private_tmp()):
        if (why := untrusted(directory)) is not None:
            logger.warning("refusing the C kernel cache %s (%s): building in a private folder instead",
                           directory, why)
            continue
        directories.append(directory)
    for directory in directories:
        built = library_path(source, version, target_cpu, directory)
        if built.exists() and _trusted_library(built):
            return built
    for directory in directories:
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            workdir = Path(tempfile.mkdtemp(prefix=".build-", dir=directory))
            break
        except OSError:
            continue
    else:
        # Nowhere shared is safe or writable: a folder of this process's own (mode 0700).
        workdir = Path(tempfile.mkdtemp(prefix="kvscale-native-"))
        logger.warning("C kernels built in %s, for this process only", workdir)
        return _compile(compiler, source, version, target_cpu, workdir, workdir)
    return _compile(compiler, source, version, target_cpu, workdir, workdir.parent)


def _compile(compiler: str, source: bytes, version: str, target_cpu: str, workdir: Path,
             directory: Path) -> Path:
    target = library_path(source, version, target_cpu, directory)
    for name in HEADERS:
        (workdir / name).write_bytes(resources.files("kvscale.kernels").joinpath(name).read_bytes())
    objects = []
    for name in SOURCES:
        text = resources.files("kvscale.kernels").joinpath(name).read_bytes()
        (workdir / name).write_bytes(text)
        objects.append(str(workdir / f"{name}.o"))
        _run_compiler([compiler, *CFLAGS, *FILE_CFLAGS.get(name, ()), "-c", "-o", objects[-1], str(workdir / name)])
    built = workdir / target.name
    _run_compiler([compiler, *LDFLAGS, "-o", str(built), *objects, *LDLIBS])
    if workdir == directory:  # a private folder of its own: the library stays in it
        for leftover in workdir.iterdir():
            if leftover != built:
                leftover.unlink()
        return built
    os.replace(built, target)
    shutil.rmtree(workdir, ignore_errors=True)
    return target


def _run_compiler(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NativeKernelError(f"{argv[0]} failed:\n{result.stderr.strip()}")


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
            raise NativeKernelError(f"the C kernels are unavailable: {exc}") from exc
        logger.warning("C kernels unavailable (%s); using PyTorch ops", exc)
        return None
    for name, (restype, argtypes) in _C_PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def bind_threads(cpus: list[int]) -> bool:
    """Pin torch's OpenMP threads one per CPU (thread i to ``cpus[i]``) and use that many from
    now on (cpu_threads.c says why); False where the C kernels do not run or a pin failed."""
    lib = _library()
    if lib is None or not cpus:
        return False
    torch.set_num_threads(len(cpus))
    array = (ctypes.c_int32 * len(cpus))(*cpus)
    return lib.kvscale_bind_threads(ctypes.cast(array, ctypes.c_void_p), len(cpus)) == 0


def available() -> bool:
    """Whether the C kernels run in this process."""
    return _library() is not None


def _fits(*tensors: Tensor) -> bool:
    """Whether the C kernels take these tensors: on the CPU, contiguous, one of their dtypes."""
    dtype = tensors[0].dtype
    return dtype in (torch.float32, torch.bfloat16) and all(
        t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors
    )


def silu_and_mul(gate_up: Tensor) -> Tensor | None:
    """``silu(gate_up[..., :n]) * gate_up[..., n:]`` in one pass, or None where the C kernels
    do not apply (the caller then runs the PyTorch ops)."""
    lib = _library()
    if lib is None or not _fits(gate_up):
        return None
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], width))
    lib.kvscale_silu_and_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * width), width,
                             int(gate_up.dtype == torch.bfloat16), torch.get_num_threads())
    return out


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> Tensor | None:
    """RMSNorm of ``x`` (or, given ``residual``, ``residual += x`` in place, then RMSNorm of it) in
    one pass; None where the C kernels do not apply."""
    lib = _library()
    tensors = (x, weight) if residual is None else (x, residual, weight)
    if lib is None or not _fits(*tensors) or (residual is not None and residual.shape != x.shape):
        return None
    width = x.shape[-1]
    out = torch.empty_like(x)
    lib.kvscale_add_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                             out.data_ptr(), x.numel() // width, width, eps, int(x.dtype == torch.bfloat16),
                             torch.get_num_threads())
    return out


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
    """Rotary embedding of ``x`` ``[tokens, heads, head_dim]`` (heads contiguous within a token,
    tokens any stride apart: the q|k part of the fused qkv output) with each token's cos/sin row
    (``[tokens, head_dim]``, or ``[tokens, 1, head_dim]``); a new contiguous tensor, or None
    where the C kernels do not apply."""
    lib = _library()
    tokens, heads, head_dim = x.shape
    cos, sin = cos.reshape(tokens, -1), sin.reshape(tokens, -1)
    if (lib is None or not _fits(cos, sin) or x.dtype != cos.dtype or x.device.type != "cpu"
            or x.stride(2) != 1 or x.stride(1) != head_dim or head_dim % 2 or cos.shape[1] != head_dim):
        return None
    out = x.new_empty((tokens, heads, head_dim))
    lib.kvscale_rope(x.data_ptr(), x.stride(0), None, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                     out.data_ptr(), tokens, heads, head_dim, int(x.dtype == torch.bfloat16),
                     torch.get_num_threads())
    return out


def quantize_rows_u8(x: Tensor) -> tuple[Tensor, Tensor] | None:
    """Each row of ``x`` ``[rows, width]`` quantized symmetrically to int8, stored +128 as uint8
    (cpu_quantize.c says why), and the float32 scale of each row; None where the C kernels do not
    apply."""
    lib = _library()
    if lib is None or not _fits(x) or x.dim() != 2:
        return None
    rows, width = x.shape
    q = torch.empty((rows, width), dtype=torch.uint8)
    scales = torch.empty(rows, dtype=torch.float32)
    lib.kvscale_quantize_rows_u8(x.data_ptr(), rows, width, int(x.dtype == torch.bfloat16), q.data_ptr(),
                                 scales.data_ptr(), torch.get_num_threads())
    return q, scales


def rescale_rows(y: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor | None:
    """``y * scales[:, None] + bias`` for ``y`` ``[rows, width]`` (float32 or bfloat16, a GEMM's
    fresh output), in place in one pass; None where the C kernels do not apply."""
    lib = _library()
    if (lib is None or not _fits(y) or y.dim() != 2 or scales.dtype != torch.float32 or not scales.is_contiguous()
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))):
        return None
    rows, width = y.shape
    is_bf16 = int(y.dtype == torch.bfloat16)
    lib.kvscale_rescale_rows(y.data_ptr(), is_bf16, scales.data_ptr(), None if bias is None else bias.data_ptr(), rows,
                             width, y.data_ptr(), is_bf16, torch.get_num_threads())
    return y


def apply_token_bitmask(logits: Tensor, rows: list[int], bitmask: Tensor) -> bool:
    """-inf in place wherever row ``rows[i]`` of ``logits`` ``[n, vocab]`` has its token's bit 0 in
    ``bitmask[i]`` (int32 words, bit j of word w = token 32w + j; tokens past them are masked
    too); False, untouched, where the C kernels do not apply."""
    lib = _library()
    if (lib is None or not _fits(logits) or logits.dim() != 2 or bitmask.dtype != torch.int32
            or not bitmask.is_contiguous() or bitmask.shape[0] != len(rows)):
        return False
    index = torch.tensor(rows, dtype=torch.int64)
    lib.kvscale_apply_token_bitmask(logits.data_ptr(), logits.stride(0), int(logits.dtype == torch.bfloat16),
                                    index.data_ptr(), len(rows), bitmask.data_ptr(), bitmask.shape[1],
                                    logits.shape[1], torch.get_num_threads())
    return True


def _check_paged(query: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """What the C attention kernels assume of a query and the paged caches they read in place."""
    reference.check_cache(k_cache, v_cache)
    reference.check_heads(query.shape[1], k_cache.shape[2])
    if k_cache.shape[3] != query.shape[2]:
        raise ValueError(f"query head_dim {query.shape[2]} does not match the cache's {k_cache.shape[3]}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def paged_decode_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Tensor:
    """:class:`kvscale.kernels.ops.DecodeAttention` in C, every sequence of a layer in one call;
    the reference where the C kernel does not apply (no compiler, another dtype or head size)."""
    lib = _library()
    head_dim = query.shape[-1]
    cache_format = fp8.cache_format(k_cache.dtype)
    if lib is None or cache_format is None or query.is_cuda or head_dim % 16 or head_dim > 128:
        return reference.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale,
                                                k_scale=k_scale, v_scale=v_scale)
    _check_paged(query, k_cache, v_cache)
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(
            f"block_tables must be [{num_seqs}, max_blocks] and context_lens [{num_seqs}], got "
            f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}"
        )
    # A bfloat16 query and output stay bfloat16 (the kernel widens and rounds each task's rows);
    # anything else goes through float32.
    io_bf16 = query.dtype == torch.bfloat16
    q = query.contiguous() if io_bf16 else query.to(torch.float32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    status = lib.kvscale_paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cache_format,
        int(query.dtype == torch.bfloat16),
        num_blocks, tables.data_ptr(), tables.shape[1], lens.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, k_scale, v_scale, out.data_ptr(),
        int(io_bf16), torch.get_num_threads(),
    )
    if status == _BAD_TABLE:
        raise ValueError(
            "a context needs more blocks than its block table row holds, or a used entry is not a "
            f"block of the {num_blocks}-block cache"
        )
    if status:
        raise MemoryError("decode attention could not allocate its score buffers")
    return out.to(query.dtype)


@functools.cache
def amx_linear_available() -> bool:
    """Whether bfloat16 projections run in C here: a build with AMX and the OS's leave to use it."""
    lib = _library()
    return lib is not None and bool(lib.kvscale_linear_amx_available())


AMX_LINEAR_MULTIPLE = 32  # cpu_linear_amx.c's blocks: in and out features are multiples of it


def pack_linear_amx(weight: Tensor) -> Tensor | None:
    """``weight`` ``[out, in]`` (bfloat16) laid out for :func:`linear_amx` (a flat tensor), or
    None where that kernel does not run it (no AMX, another dtype, sizes not multiples of 32)."""
    out_features, in_features = weight.shape
    if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or out_features % AMX_LINEAR_MULTIPLE
            or in_features % AMX_LINEAR_MULTIPLE or not amx_linear_available()):
        return None
    plain = weight.detach().contiguous()
    packed = torch.empty(plain.numel(), dtype=torch.bfloat16)
    lib = _library()
    assert lib is not None  # amx_linear_available() said so
    lib.kvscale_linear_amx_pack(plain.data_ptr(), out_features, in_features, packed.data_ptr())
    return packed


def silu_mul_fits(out_features: int) -> bool:
    """Whether a gate|up projection of ``out_features`` can apply SiLU-and-multiply as it stores:
    each half a whole number of the kernels' 32-column blocks."""
    return out_features % (2 * AMX_LINEAR_MULTIPLE) == 0


def linear_amx(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int, silu_mul: bool = False) -> Tensor:
    """``x W^T (+ bias)`` for ``x`` ``[..., in]`` bfloat16 and ``packed`` from
    :func:`pack_linear_amx`; ``bias`` float32 or None. With ``silu_mul`` (W a fused gate|up, see
    :func:`silu_mul_fits`), ``silu_and_mul`` of that product instead, bit for bit, in one pass."""
    in_features = x.shape[-1]
    rows = x.reshape(-1, in_features)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = x.new_empty((*x.shape[:-1], out_features // 2 if silu_mul else out_features))
    lib = _library()
    assert lib is not None  # pack_linear_amx() needed it
    status = lib.kvscale_linear_amx(rows.data_ptr(), rows.stride(0), packed.data_ptr(),
                                    None if bias is None else bias.data_ptr(), rows.shape[0], out_features,
                                    in_features, out.data_ptr(), int(silu_mul), torch.get_num_threads())
    _check_linear_status(status)
    return out


_LINEAR_UNSUPPORTED = 1  # cpu_linear_amx.c's KVSCALE_LINEAR_UNSUPPORTED


def _check_linear_status(status: int) -> None:
    if status == _LINEAR_UNSUPPORTED:
        raise ValueError("the AMX projection cannot run this call: no AMX tiles granted here, or silu_mul on "
                         "halves that split a 32-column block (silu_mul_fits says which shapes fit)")
    if status:
        raise MemoryError("the AMX projection could not allocate its activation buffer")


AMX_INT8_DEPTH = 64  # cpu_linear_amx.c's int8 blocks: in features are a multiple of it


def pack_linear_amx_int8(weight: Tensor) -> tuple[Tensor, Tensor] | None:
    """An int8 ``weight`` ``[out, in]`` laid out for :func:`linear_amx_int8`, and each output
    column's weight sum (int32); None where that kernel does not run it."""
    out_features, in_features = weight.shape
    if (weight.dtype != torch.int8 or weight.device.type != "cpu" or out_features % AMX_LINEAR_MULTIPLE
            or in_features % AMX_INT8_DEPTH or not amx_linear_available()):
        return None
    plain = weight.contiguous()
    packed = torch.empty(plain.numel(), dtype=torch.int8)
    column_sums = torch.empty(out_features, dtype=torch.int32)
    lib = _library()
    assert lib is not None  # amx_linear_available() said so
    lib.kvscale_linear_amx_int8_pack(plain.data_ptr(), out_features, in_features, packed.data_ptr(),
                                     column_sums.data_ptr())
    return packed, column_sums


def linear_amx_int8(xq: Tensor, x_scales: Tensor, packed: tuple[Tensor, Tensor], w_scales: Tensor,
                    bias: Tensor | None, out_dtype: torch.dtype, silu_mul: bool = False) -> Tensor:
    """``(xq - 128) Wq^T * w_scales * x_scales[:, None] + bias`` in ``out_dtype`` (bfloat16 or
    float32): ``xq`` ``[rows, in]`` uint8 (int8 values +128) with float32 ``x_scales``, the
    weight from :func:`pack_linear_amx_int8`, float32 ``w_scales`` and ``bias``; ``silu_mul`` as
    in :func:`linear_amx`."""
    weight, column_sums = packed
    # Named: a temporary's memory would be freed once its data_ptr() was read, before the call.
    xq, x_scales = xq.contiguous(), x_scales.contiguous()
    rows, in_features = xq.shape
    out_features = column_sums.shape[0]
    out = torch.empty((rows, out_features // 2 if silu_mul else out_features), dtype=out_dtype)
    lib = _library()
    assert lib is not None  # pack_linear_amx_int8() needed it
    status = lib.kvscale_linear_amx_int8(
        xq.data_ptr(), x_scales.data_ptr(), weight.data_ptr(), column_sums.data_ptr(),
        w_scales.data_ptr(), None if bias is None else bias.data_ptr(), rows, out_features, in_features,
        out.data_ptr(), int(out_dtype == torch.bfloat16), int(silu_mul), torch.get_num_threads())
    _check_linear_status(status)
    return out


def step_layers(layers: ctypes.Array, shape: DecoderShape, hidden: Tensor, residual: Tensor, positions: Tensor,
                  cos_table: Tensor, sin_table: Tensor, slots: Tensor, attention: StepAttention) -> None:
    """Every decoder layer of a step in one call (cpu_step_layers.c): ``hidden`` ``[rows,
    hidden]`` bfloat16 holds the embeddings and is left holding the last layer's MLP output,
    ``residual`` (same shape) the residual stream. The caller checked that each kernel applies and
    keeps the tensors ``attention`` points into alive (server/cpu_step_layers.py); positions and
    slots are int64, contiguous."""
    lib = _library()
    assert lib is not None  # the AMX projections it chains needed it
    status = lib.kvscale_step_layers(
        ctypes.byref(layers), len(layers), ctypes.byref(shape), hidden.data_ptr(), residual.data_ptr(),
        hidden.shape[0], positions.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr(), cos_table.stride(0),
        slots.data_ptr(), ctypes.byref(attention), torch.get_num_threads())
    if status == 1:
        raise MemoryError("the step's layers could not allocate their buffers")
    if status == 2:
        raise RuntimeError("an AMX projection refused the step's rows")
    if status == 3:
        raise ValueError(f"a slot in slot_mapping is outside the {shape.num_blocks * shape.block_size}-slot cache")
    if status == 4:
        raise ValueError(
            "a sequence has more new tokens than context, or needs more blocks than its block table row "
            f"holds, or a used entry is not a block of the {shape.num_blocks}-block cache"
        )


def decode_attention_on_amx(cache_dtype: torch.dtype, query_dtype: torch.dtype, block_size: int, num_heads: int,
                            num_kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`paged_decode_attention` runs these shapes on AMX tiles here: a bfloat16 or
    FP8 cache with a bfloat16 query, blocks of whole 16-key tiles, heads of 64 or 128 dims, GQA
    groups up to 16, on a build with AMX and the OS's leave to use it. Elsewhere the C kernel's AVX-512 (or plain) loops serve them."""
    lib = _library()
    cache_format = fp8.cache_format(cache_dtype)
    return lib is not None and cache_format is not None and bool(lib.kvscale_decode_attention_on_amx(
        cache_format, int(query_dtype == torch.bfloat16), block_size, num_heads, num_kv_heads, head_dim))


@functools.cache
def amx_prefill_available() -> bool:
    """Whether bfloat16 prefill attention runs in C here: a build with AMX and the OS's leave to use it."""
    lib = _library()
    return lib is not None and bool(lib.kvscale_prefill_attention_available())


@functools.cache
def f32_prefill_available() -> bool:
    """Whether float32 prefill attention runs in C here: a build with AVX2 and FMA."""
    lib = _library()
    return lib is not None and bool(lib.kvscale_prefill_attention_f32_available())


@functools.cache
def narrow_linear_available() -> bool:
    """Whether projections with a bf16 or int8 weight can run on a few float32 rows in C here
    (cpu_linear_narrow.c): a build with AVX2 and FMA."""
    lib = _library()
    return lib is not None and bool(lib.kvscale_linear_narrow_available())


def linear_narrow(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` in float32 for float32 ``x`` ``[rows, in]`` (a unit stride in a row) and a
    contiguous bfloat16 or int8 ``weight`` ``[out, in]``, widened as it is read; only where
    :func:`narrow_linear_available`."""
    assert weight.dtype in (torch.bfloat16, torch.int8) and weight.is_contiguous() and x.stride(1) == 1
    rows, in_features = x.shape
    out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
    lib = _library()
    assert lib is not None  # narrow_linear_available() said so
    status = lib.kvscale_linear_narrow(x.data_ptr(), rows, x.stride(0), weight.data_ptr(),
                                       int(weight.dtype == torch.int8), weight.shape[0], in_features,
                                       out.data_ptr(), torch.get_num_threads())
    if status:
        raise ValueError("the narrow projection is not built here (no AVX2 and FMA): check narrow_linear_available()")
    return out


def paged_prefill_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Tensor:
    """:class:`kvscale.kernels.ops.PrefillAttention`: every multi-token sequence of a layer in one C
    call, and the single-token ones through the C decode kernel, where a kernel takes the dtypes:
    on CPUs with AMX a bfloat16 query with a bfloat16 or FP8 cache (cpu_prefill_attention.c), on
    CPUs with AVX2 and FMA a float32 query and cache (cpu_prefill_attention_f32.c); elsewhere the
    PyTorch reference (other dtypes and head sizes)."""
    num_tokens, num_heads, head_dim = query.shape
    layout_ok = query.device.type == "cpu" and query.stride(2) == 1 and query.stride(1) == head_dim
    f32 = (layout_ok and query.dtype == torch.float32 and k_cache.dtype == torch.float32
           and head_dim % 8 == 0 and head_dim <= 256 and f32_prefill_available())
    amx = (layout_ok and query.dtype == torch.bfloat16
           and (k_cache.dtype == torch.bfloat16 or fp8.is_fp8(k_cache.dtype))
           and head_dim % 32 == 0 and head_dim <= 256 and amx_prefill_available())
    if not (f32 or amx):
        return reference.paged_prefill_attention(
            query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, decode=paged_decode_attention,
            k_scale=k_scale, v_scale=v_scale,
        )
    _check_paged(query, k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    starts = query_start_loc.to(torch.int32).contiguous()
    if starts.shape != (num_seqs + 1,) or int(starts[0]) != 0 or int(starts[-1]) != num_tokens:
        raise ValueError(f"query_start_loc {starts.tolist()} does not describe {num_tokens} tokens of {num_seqs} seqs")
    lens = context_lens.to(torch.int32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    out = query.new_empty((num_tokens, num_heads, head_dim))
    lib = _library()
    assert lib is not None  # f32_prefill_available() or amx_prefill_available() said so
    paged = (query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks,
             tables.data_ptr(), tables.shape[1], starts.data_ptr(), lens.data_ptr(),
             num_seqs, num_heads, num_kv_heads, head_dim, block_size)
    if f32:
        status = lib.kvscale_paged_prefill_attention_f32(*paged, scale, out.data_ptr(), torch.get_num_threads())
    else:
        status = lib.kvscale_paged_prefill_attention(*paged, fp8.cache_format(k_cache.dtype), k_scale, v_scale,
                                                     scale, out.data_ptr(), torch.get_num_threads())
    if status == _BAD_TABLE:
        raise ValueError(
            "a sequence has more new tokens than context, or needs more blocks than its block table "
            f"row holds, or a used entry is not a block of the {num_blocks}-block cache"
        )
    if status:
        raise MemoryError("prefill attention could not allocate its packed K/V")
    # Single-token sequences (decodes inside a mixed batch): the kernel left their rows to this.
    single = ((starts[1:] - starts[:-1]) == 1).nonzero().flatten()
    if single.numel():
        rows = starts[:-1].index_select(0, single).long()
        out[rows] = paged_decode_attention(
            query.index_select(0, rows), k_cache, v_cache, block_tables.index_select(0, single.to(block_tables.device)),
            context_lens.index_select(0, single.to(context_lens.device)), scale, k_scale=k_scale, v_scale=v_scale,
        )
    return out


def write_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
    *, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """:class:`kvscale.kernels.ops.WriteKV` in C (two row copies per token, or two rows quantized
    into an FP8 cache); the reference where the C kernels do not run or the rows need a cast or
    are not contiguous per token."""
    lib = _library()
    # First, so that a malformed key gets its ValueError before any stride is read below.
    reference.check_write_kv(key, value, k_cache, v_cache, slot_mapping)
    quantized = fp8.is_fp8(k_cache.dtype)
    if (lib is None or k_cache.dtype != v_cache.dtype or key.dtype != value.dtype
            or (key.dtype not in (torch.float32, torch.bfloat16) if quantized else key.dtype != k_cache.dtype)
            or key.device.type != "cpu" or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or any(t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in (key, value))):
        reference.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return
    slots = slot_mapping.to(torch.int64).contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if quantized:
        status = lib.kvscale_write_kv_fp8(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                          k_cache.data_ptr(), v_cache.data_ptr(), num_slots, slots.data_ptr(),
                                          key.shape[0], key.shape[1] * key.shape[2], int(key.dtype == torch.bfloat16),
                                          fp8.cache_format(k_cache.dtype), k_scale, v_scale)
    else:
        status = lib.kvscale_write_kv(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                      k_cache.data_ptr(), v_cache.data_ptr(), num_slots, slots.data_ptr(),
                                      key.shape[0], key.shape[1] * key.shape[2], key.element_size())
    if status:
        raise ValueError(f"a slot in slot_mapping is outside the {num_slots}-slot cache")


# The engine's CPU path: KV writes and decode attention in C (also for the decode tokens of
# mixed batches), prefill attention in C on AMX CPUs with a bfloat16 model and on AVX2 CPUs with a
# float32 one, the rest of prefill attention in PyTorch (one gather and one SDPA per group of
# equal sequences).
CPU = KernelBackend(
    "cpu",
    write_kv=write_kv,
    paged_decode_attention=paged_decode_attention,
    paged_prefill_attention=paged_prefill_attention,
    prefill_batches_decodes=True,
)
