"""Building and loading the C kernels: the compiler's flags, the cache a build is kept in, the
library loaded with its prototypes (cpu_prototypes.py), and the switch that picks C or PyTorch.

The C sources (``SOURCES``) are compiled into one library by the machine's C compiler for the
machine it runs on (``-march=native``), into ``$KVSCALE_CACHE/native/`` (or
``$TMPDIR/kvscale-native-UID/`` when that is read-only, as in the engine image) under a name
derived from the sources, the flags, the compiler and the CPU it targets, so a changed source or
another CPU never loads a stale build; concurrent processes each rename a finished file into
place. A folder another user owns or may write to is never read (a library planted there would
run in this process). Where no compiler exists PyTorch ops are used, with one warning; every
entry point returns None (or runs the reference) for what it does not take.

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
import stat
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch

from kvscale.kernels.cpu_prototypes import C_PROTOTYPES

logger = logging.getLogger(__name__)

SOURCES = ("cpu_decode_attention.c", "cpu_prefill_attention.c", "cpu_prefill_attention_f32.c", "cpu_write_kv.c",
           "cpu_layer_ops.c", "cpu_quantize.c", "cpu_linear_amx.c", "cpu_token_mask.c", "cpu_threads.c",
           "cpu_step_layers.c", "cpu_linear_narrow.c", "cpu_lora.c", "cpu_moe.c", "cpu_linear_dot.c")
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
    library under the very name this build looks for, and loading it runs its code. A symbolic
    link is refused too: whoever made it chose where this build writes."""
    try:
        info = directory.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return None  # could not be made (a read-only cache): nothing to read, nowhere to write
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link"
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
        # Made first (0700 when absent), checked after: checking an absent folder and making it
        # later would let another user make it in between, in the shared /tmp.
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            pass  # a read-only cache is still read
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
def library() -> ctypes.CDLL | None:
    """The C kernels loaded in this process, or None where they do not run (no compiler, or
    ``KVSCALE_CPU_KERNELS=reference``); built on the first call."""
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
    for name, (restype, argtypes) in C_PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def bind_threads(cpus: list[int]) -> bool:
    """Pin torch's OpenMP threads one per CPU (thread i to ``cpus[i]``) and use that many from
    now on (cpu_threads.c says why); False where the C kernels do not run or a pin failed."""
    lib = library()
    if lib is None or not cpus:
        return False
    torch.set_num_threads(len(cpus))
    array = (ctypes.c_int32 * len(cpus))(*cpus)
    return lib.kvscale_bind_threads(ctypes.cast(array, ctypes.c_void_p), len(cpus)) == 0


def available() -> bool:
    """Whether the C kernels run in this process."""
    return library() is not None
