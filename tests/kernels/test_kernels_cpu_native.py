"""The C decode attention (the engine's CPU decode path) against dense attention and the reference."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
from importlib import resources
from pathlib import Path

import pytest
import torch
from kernel_checks import (
    TOLERANCE,
    cpu_has_amx_bf16,
    dense_attention,
    make_case,
    max_error,
    random_case,
)

import kvscale.kernels as kernels
from kvscale.kernels import cpu_build, cpu_native, cpu_prototypes, cpu_row_ops, reference

pytestmark = pytest.mark.usefixtures("fresh_cpu_library")


def _run(case, impl=cpu_native.paged_decode_attention) -> torch.Tensor:
    return impl(case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale)


def test_the_kernel_builds_here() -> None:
    # The test machine has a C compiler (tools/system-deps.sh installs one): a build failure here
    # is a defect, not a reason to fall back quietly.
    assert cpu_native.available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", range(8))
def test_native_decode_matches_dense(seed: int, dtype: torch.dtype) -> None:
    case = random_case(torch.Generator().manual_seed(seed), decode=True, dtype=dtype)
    out = _run(case)
    assert out.shape == case.query.shape and out.dtype == dtype
    assert max_error(out, dense_attention(case)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("num_seqs", [1, 3, 40], ids=lambda n: f"{n}seqs")
def test_both_task_shapes_match_the_reference(num_seqs: int) -> None:
    # Few sequences are split per KV head across threads, many run whole: both must agree.
    gen = torch.Generator().manual_seed(num_seqs)
    lens = torch.randint(1, 300, (num_seqs,), generator=gen).tolist()
    case = make_case(gen, context_lens=lens, q_lens=[1] * num_seqs, num_heads=9, num_kv_heads=3,
                     head_dim=64, block_size=16)
    assert max_error(_run(case), _run(case, reference.paged_decode_attention)) <= 1e-5


def test_padding_sequences_give_zeros() -> None:
    case = make_case(torch.Generator().manual_seed(1), context_lens=[5, 1], q_lens=[1, 1],
                     num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    lens = torch.tensor([5, 0], dtype=torch.int32)
    out = cpu_native.paged_decode_attention(case.query, case.k_cache, case.v_cache,
                                            case.block_tables, lens, case.scale)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0


def test_a_bad_block_table_raises_instead_of_reading_out_of_bounds() -> None:
    case = make_case(torch.Generator().manual_seed(2), context_lens=[20], q_lens=[1],
                     num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    outside = case.block_tables.clone()
    outside[0, 1] = case.k_cache.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="not a block of the"):
        cpu_native.paged_decode_attention(case.query, case.k_cache, case.v_cache, outside,
                                          case.context_lens, case.scale)
    too_long = torch.tensor([8 * case.block_tables.shape[1] + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="more blocks than its block table row"):
        cpu_native.paged_decode_attention(case.query, case.k_cache, case.v_cache,
                                          case.block_tables, too_long, case.scale)


def test_the_cpu_backend_runs_it_for_every_decode_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # Decode batches, and the single-token sequences of mixed batches, reach the C kernel.
    lib = cpu_build.library()
    assert lib is not None
    calls: list[int] = []
    real = lib.kvscale_paged_decode_attention

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(lib, "kvscale_paged_decode_attention", counting)
    backend = kernels.backend_for(torch.device("cpu"))
    case = random_case(torch.Generator().manual_seed(3), decode=True)
    _run(case, backend.paged_decode_attention)
    prefill = random_case(torch.Generator().manual_seed(4), decode=False)
    backend.paged_prefill_attention(prefill.query, prefill.k_cache, prefill.v_cache,
                                    prefill.block_tables, prefill.query_start_loc,
                                    prefill.context_lens, prefill.scale)
    assert len(calls) == 1 + (1 in prefill.q_lens)


class RememberingCompiler:
    """``cpu_build._run_compiler`` that runs each distinct command once per module and replays its
    output after: the tests that build into folders of their own check where a build goes and when
    it is reused, not the compiler, which every kernel test here exercises through the real build.
    Each replay writes the output where the command names it, as the compiler would."""

    def __init__(self) -> None:
        self.outputs: dict[tuple[str, ...], bytes] = {}
        self.calls = 0

    def __call__(self, argv: list[str]) -> None:
        self.calls += 1
        output = Path(argv[argv.index("-o") + 1])
        # Each build compiles in a fresh work folder: the command is the same one apart from it.
        key = tuple(arg.replace(str(output.parent), "<workdir>") for arg in argv)
        if key not in self.outputs:
            REAL_RUN_COMPILER(argv)
            self.outputs[key] = output.read_bytes()
        output.write_bytes(self.outputs[key])


REAL_RUN_COMPILER = cpu_build._run_compiler


@pytest.fixture(scope="module")
def compiler_memory() -> RememberingCompiler:
    return RememberingCompiler()


@pytest.fixture
def remembering_compiler(compiler_memory: RememberingCompiler,
                         monkeypatch: pytest.MonkeyPatch) -> RememberingCompiler:
    monkeypatch.setattr(cpu_build, "_run_compiler", compiler_memory)
    return compiler_memory


def test_build_is_cached_by_source_flags_and_compiler(
    tmp_path: Path, remembering_compiler: RememberingCompiler
) -> None:
    first = cpu_build.build(tmp_path)
    calls = remembering_compiler.calls
    stamp = first.stat().st_mtime_ns
    assert cpu_build.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert remembering_compiler.calls == calls  # the second build ran no compiler command
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no build directory left behind
    other = cpu_build.library_path(b"another source", "gcc 12", "-march=znver4", tmp_path)
    assert other != cpu_build.library_path(b"another source", "gcc 13", "-march=znver4", tmp_path) != first
    # -march=native means another instruction set on another CPU: a cache shared between
    # machines must never hand an AVX-512 build to an older CPU.
    assert other != cpu_build.library_path(b"another source", "gcc 12", "-march=haswell", tmp_path)


def test_the_key_names_the_cpu_the_compiler_targets() -> None:
    compiler = cpu_build.shutil.which("cc")
    assert compiler is not None
    target = cpu_build.target_of(compiler)
    assert "-march=" in target  # what -march=native resolved to on this machine
    flags = Path("/proc/cpuinfo").read_text()
    if " avx2" in flags:
        assert "-mavx2" in target.split()


def _plant(directory: Path, owner: int, mode: int) -> Path:
    """A library under the name the build would look for, in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    compiler = cpu_build.shutil.which("cc")
    assert compiler is not None
    planted = cpu_build.library_path(
        cpu_build.source_bytes(), cpu_build.compiler_id(compiler), cpu_build.target_of(compiler),
        directory)
    planted.write_bytes(b"not a library")
    os.chown(directory, owner, owner)
    os.chown(planted, owner, owner)
    directory.chmod(mode)
    return planted


@pytest.mark.parametrize(("owner", "mode"), [(65534, 0o700), (65534, 0o755), (os.geteuid(), 0o777)],
                         ids=["another-user", "another-user-readable", "world-writable"])
def test_a_library_in_a_directory_others_control_is_never_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, owner: int, mode: int,
    remembering_compiler: RememberingCompiler,
) -> None:
    pod_tmp = tmp_path / "tmp"
    pod_tmp.mkdir()
    monkeypatch.setattr(cpu_build.tempfile, "tempdir", str(pod_tmp))
    # Both places a build is looked for, prepared by someone else.
    planted = [_plant(tmp_path / "cache", owner, mode),
               _plant(pod_tmp / f"kvscale-native-{os.geteuid()}", owner, mode)]
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        built = cpu_build.build(tmp_path / "cache")
    assert built not in planted and built.read_bytes() != b"not a library"
    assert built.parent.stat().st_uid == os.geteuid() and built.parent.stat().st_mode & 0o077 == 0
    assert "refusing" in caplog.text and str(tmp_path / "cache") in caplog.text


def test_no_compiler_falls_back_with_a_warning_or_fails_when_forced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KVSCALE_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert not cpu_native.available()
    assert "no C compiler" in caplog.text
    case = random_case(torch.Generator().manual_seed(5), decode=True)
    assert max_error(_run(case), dense_attention(case)) <= TOLERANCE[torch.float32]

    cpu_build.library.cache_clear()
    monkeypatch.setenv("KVSCALE_CPU_KERNELS", "native")
    with pytest.raises(cpu_build.NativeKernelError, match="no C compiler"):
        cpu_native.available()


def test_reference_mode_and_a_bad_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSCALE_CPU_KERNELS", "reference")
    assert not cpu_native.available()
    cpu_build.library.cache_clear()
    monkeypatch.setenv("KVSCALE_CPU_KERNELS", "fast")
    with pytest.raises(ValueError, match="expected one of auto, native, reference"):
        cpu_native.available()


@pytest.mark.parametrize("head_dim", [16, 80, 96, 128, 24, 192])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_head_size_matches_dense(head_dim: int, dtype: torch.dtype) -> None:
    # 64 and 128 run unrolled, other multiples of 16 the general loop, the rest the reference;
    # bf16 scores come from bf16 dot products on multiples of 32 (where the CPU has them).
    gen = torch.Generator().manual_seed(head_dim)
    case = make_case(gen, context_lens=[37, 70, 5], q_lens=[1, 1, 1], num_heads=8, num_kv_heads=2,
                     head_dim=head_dim, block_size=16, dtype=dtype)
    assert max_error(_run(case), dense_attention(case)) <= TOLERANCE[dtype]


# --- the layer's elementwise steps (cpu_layer_ops.c) -----------------------------------------


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, the numerics the kernel follows."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


LAYER_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (7, 1536), (300, 1536), (7, 1551), (3, 47), (5, 15)])
def test_silu_and_mul_matches_torch(rows: int, width: int, dtype: torch.dtype) -> None:
    gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(rows)).mul(4).to(dtype)
    gate, up = gate_up.split(width, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    out = cpu_native.silu_and_mul(gate_up)
    assert out is not None and out.dtype == dtype and out.shape == expected.shape
    # bfloat16: at most one rounding step apart from torch's (relative to the values' size).
    error = (out.float() - expected.float()).abs() / expected.float().abs().clamp_min(1.0)
    assert float(error.max()) <= LAYER_TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_and_mul_below_the_exp_overflow_is_tiny_not_nan(dtype: torch.dtype) -> None:
    """exp(-gate) overflows below gate = -88.7; the vectorised division (reciprocal estimate and
    Newton step) once turned gate / inf into NaN there, which the rest of the layer spreads."""
    width = 1551  # 32-value steps, a 16-value step and a scalar tail
    gate = torch.linspace(-400.0, -80.0, width).to(dtype)
    gate_up = torch.cat((gate, torch.full((width,), 3.0))).to(dtype).repeat(3, 1)
    out = cpu_native.silu_and_mul(gate_up)
    assert out is not None and not out.isnan().any()
    expected = torch.nn.functional.silu(gate) * 3  # -0 past the overflow, ~1e-36 before it
    assert float((out[0].float() - expected.float()).abs().max()) <= 1e-34


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(("rows", "width"), [(33, 576), (1, 576), (19, 577), (3, 13), (200, 576)])
def test_add_rms_norm_matches_torch(rows: int, width: int, with_residual: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(int(with_residual))
    x = torch.randn(rows, width, generator=gen).to(dtype)
    residual = torch.randn(rows, width, generator=gen).to(dtype)
    weight = torch.rand(width, generator=gen).add(0.5).to(dtype)
    summed = residual + x
    expected = _torch_rms_norm(summed if with_residual else x, weight, 1e-5)
    stream = residual.clone()
    out = cpu_native.add_rms_norm(x, stream if with_residual else None, weight, 1e-5)
    assert out is not None and out.dtype == dtype
    error = (out.float() - expected.float()).abs() / expected.float().abs().clamp_min(1.0)
    assert float(error.max()) <= LAYER_TOLERANCE[dtype]
    # The residual stream is updated in place with the sum (and left alone without one).
    assert torch.equal(stream, summed if with_residual else residual)


def test_row_ops_take_a_second_thread_only_past_the_grain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    grain = cpu_row_ops.ROW_OP_GRAIN
    assert [cpu_row_ops.threads_for(n) for n in (0, 8 * 576, grain - 1, grain, 3 * grain, 100 * grain)] == [
        1, 1, 1, 1, 3, 4]


@pytest.mark.parametrize("rows", [4, 200])
def test_row_ops_give_the_same_bits_on_one_thread_as_on_several(rows: int) -> None:
    """The rows are split between threads, never a row's sum: the thread count changes no bit."""
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen)
    weight, gate_up = torch.rand(576, generator=gen), torch.randn(rows, 3072, generator=gen)
    before = torch.get_num_threads()

    def run() -> list[torch.Tensor]:
        stream = residual.clone()
        normed = cpu_native.add_rms_norm(x, stream, weight, 1e-5)
        activated = cpu_native.silu_and_mul(gate_up)
        assert normed is not None and activated is not None
        return [normed, stream, activated]

    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(max(2, before))
        several = run()
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, several, strict=True))


@pytest.fixture(scope="module")
def portable_layer_ops(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """cpu_layer_ops.c built again with -DKVSCALE_PORTABLE: only the plain C loops, as the compiler
    vectorises them (what the engine ran before the explicit AVX-512 loops, and still runs on CPUs
    without AVX-512)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    assert compiler is not None
    directory = tmp_path_factory.mktemp("portable")
    source = directory / "cpu_layer_ops.c"
    source.write_bytes(resources.files("kvscale.kernels").joinpath("cpu_layer_ops.c").read_bytes())
    built = directory / "layer_ops.so"
    cpu_build._run_compiler([compiler, *cpu_build.CFLAGS, "-DKVSCALE_PORTABLE", "-c", "-o",
                             str(directory / "layer_ops.o"), str(source)])
    cpu_build._run_compiler([compiler, *cpu_build.LDFLAGS, "-o", str(built), str(directory / "layer_ops.o"),
                             *cpu_build.LDLIBS])
    lib = ctypes.CDLL(str(built))
    for name in ("kvscale_silu_and_mul", "kvscale_add_rms_norm"):
        restype, argtypes = cpu_prototypes.C_PROTOTYPES[name]
        getattr(lib, name).restype = restype
        getattr(lib, name).argtypes = argtypes
    return lib


def _activations(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Ordinary values with some that take the kernels' rare paths: large (exp over- or
    underflows), tiny (subnormal in float32) and huge ones."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen) * 4
    pick = torch.rand(shape, generator=gen)
    values = torch.where(pick < 0.03, torch.randn(shape, generator=gen) * 60, values)
    values = torch.where(pick > 0.99, torch.randn(shape, generator=gen) * 1e-39, values)
    values = torch.where((pick > 0.98) & (pick <= 0.99), torch.randn(shape, generator=gen) * 1e30, values)
    return values.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


# Every split of a row: 32-value steps, a 16-value step (width % 32 >= 16), a scalar tail.
ODD_WIDTHS = [1, 15, 16, 17, 31, 32, 33, 47, 63, 575, 576, 1536, 1551]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_layer_ops_give_the_portable_loops_bits(
    dtype: torch.dtype, threads: int, portable_layer_ops: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The explicit AVX-512 loops (on CPUs with them) change speed, not numerics: every output
    and the updated residual are bit-identical to the portable C loops' (NaN where they give NaN).
    CPU-dependent: only an AVX-512 CPU builds the explicit loops; elsewhere both libraries hold
    the portable loops. It failed on a Zen 5 EPYC, whose gcc 12 tuning (znver3) kept the portable
    float32 sum of squares unfused while the explicit loop fused it."""
    native = cpu_build.library()
    assert native is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for width in ODD_WIDTHS:
            for rows in (1, 5, 37):
                seed = width * 100 + rows
                gate_up = _activations((rows, 2 * width), dtype, seed)
                x, residual = _activations((rows, width), dtype, seed + 1), _activations((rows, width), dtype, seed + 2)
                weight = (torch.rand(width, generator=torch.Generator().manual_seed(seed)) + 0.5).to(dtype)
                results = []
                for lib in (native, portable_layer_ops):
                    with monkeypatch.context() as patch:
                        patch.setattr(cpu_row_ops, "library", lambda lib=lib: lib)
                        stream = residual.clone()
                        results.append([cpu_native.silu_and_mul(gate_up), cpu_native.add_rms_norm(x, None, weight, 1e-5),
                                        cpu_native.add_rms_norm(x, stream, weight, 1e-5), stream])
                for name, got, want in zip(("silu_and_mul", "rms_norm", "add + rms_norm", "residual"), *results,
                                           strict=True):
                    nan = torch.isnan(want)
                    assert torch.equal(torch.isnan(got), nan), (name, width, rows)
                    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan]), (name, width, rows)
    finally:
        torch.set_num_threads(before)


def test_layer_ops_leave_what_they_do_not_take_to_torch() -> None:
    half = torch.randn(4, 64).half()
    assert cpu_native.silu_and_mul(half) is None  # float16: not a C kernel dtype
    strided = torch.randn(4, 128)[:, ::2]
    assert cpu_native.add_rms_norm(strided, None, torch.ones(64), 1e-5) is None  # not contiguous
    mixed = torch.randn(4, 64)
    assert cpu_native.add_rms_norm(mixed, None, torch.ones(64).bfloat16(), 1e-5) is None


def test_a_read_only_cache_builds_once_in_the_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remembering_compiler: RememberingCompiler
) -> None:
    # A cache that cannot be created or written, even by root (a path under a regular file),
    # stands for the image's read-only one.
    blocker = tmp_path / "read-only"
    blocker.write_text("")
    unwritable = blocker / "native"
    pod_tmp = tmp_path / "pod-tmp"
    pod_tmp.mkdir()
    monkeypatch.setattr(cpu_build.tempfile, "tempdir", str(pod_tmp))
    first = cpu_build.build(unwritable)
    # One folder per user, private: nobody else can put a library where this user loads one.
    assert first.parent == pod_tmp / f"kvscale-native-{os.geteuid()}"
    assert first.parent.stat().st_mode & 0o777 == 0o700
    stamp = first.stat().st_mtime_ns
    assert cpu_build.build(unwritable) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_matches_the_models_formula_on_fused_qkv_rows(dtype: torch.dtype) -> None:
    from kvscale.kernels.layer_ops import torch_rope

    gen = torch.Generator().manual_seed(11)
    tokens, q_heads, kv_heads, head_dim = 37, 9, 3, 64
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    heads = qkv[:, : (q_heads + kv_heads) * head_dim].view(tokens, -1, head_dim)  # rows strided
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)[:, None]
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)[:, None]
    out = cpu_native.rope(heads, cos, sin)
    expected = torch_rope(heads, cos, sin)
    assert out is not None and out.is_contiguous() and out.shape == expected.shape
    assert max_error(out, expected) <= LAYER_TOLERANCE[dtype] * 4


def test_loading_the_kernels_leaves_the_process_floating_point_state_alone() -> None:
    # gcc links crtfastmath.o into a -ffast-math shared library, which turns on flush-to-zero /
    # denormals-are-zero for the whole process at load: torch's and Python's own arithmetic would
    # then lose every subnormal (hypothesis refuses to run in such a process).
    assert cpu_native.available()
    smallest = 5e-324  # the smallest double, subnormal
    assert smallest * 1.0 > 0.0
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # subnormal in float32
    assert float((tiny * 1.0)[0]) > 0.0


def test_a_float32_query_over_a_bf16_cache_is_not_rounded_to_bf16() -> None:
    """bf16 dot products serve only bf16 queries: a float32 query's scores stay float32 math on
    the widened cache (rounding it would move the output by ~1e-3, not ~1e-6)."""
    case = make_case(torch.Generator().manual_seed(7), context_lens=[70, 33], q_lens=[1, 1], num_heads=9,
                     num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16)
    query = torch.randn(case.query.shape, generator=torch.Generator().manual_seed(8))  # not bf16 values
    args = (query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale)
    assert max_error(cpu_native.paged_decode_attention(*args), reference.paged_decode_attention(*args)) <= 1e-5


# Contexts around the AMX path's 16-key score tiles and 32-key value steps.
AMX_EDGE_CONTEXTS = [1, 15, 16, 17, 31, 32, 33, 64, 200]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (8, 8), (16, 1), (32, 2)], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_bf16_decode_on_amx_tiles_matches_dense(num_heads: int, num_kv_heads: int, head_dim: int,
                                                block_size: int) -> None:
    """A bfloat16 cache in whole 16-key blocks runs on AMX tiles where the CPU has them (GQA
    groups up to a tile's 16 columns); every shape matches dense attention either way."""
    case = make_case(torch.Generator().manual_seed(head_dim + block_size + num_heads), context_lens=AMX_EDGE_CONTEXTS,
                     q_lens=[1] * len(AMX_EDGE_CONTEXTS), num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16)
    on_amx = cpu_native.decode_attention_on_amx(torch.bfloat16, torch.bfloat16, block_size, num_heads, num_kv_heads,
                                                head_dim)
    assert on_amx == cpu_has_amx_bf16()
    assert max_error(_run(case), dense_attention(case)) <= TOLERANCE[torch.bfloat16]


def test_which_shapes_go_to_amx_tiles() -> None:
    # Blocks that split a 16-key tile, a group wider than a tile's 16 columns, heads that are not
    # whole 64-dim value chunks, a float32 query, a float32 cache: the AVX-512 path.
    amx = cpu_has_amx_bf16()
    bf16 = torch.bfloat16
    assert cpu_native.decode_attention_on_amx(bf16, bf16, 16, 9, 3, 64) == amx
    assert not cpu_native.decode_attention_on_amx(bf16, bf16, 8, 9, 3, 64)
    assert not cpu_native.decode_attention_on_amx(bf16, bf16, 16, 34, 2, 64)
    assert not cpu_native.decode_attention_on_amx(bf16, bf16, 16, 8, 2, 96)
    assert not cpu_native.decode_attention_on_amx(bf16, torch.float32, 16, 9, 3, 64)
    assert not cpu_native.decode_attention_on_amx(torch.float32, torch.float32, 16, 9, 3, 64)
    assert not cpu_native.decode_attention_on_amx(torch.float8_e4m3fn, torch.float32, 16, 9, 3, 64)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):  # widened to bfloat16 in L1, then tiles
        assert cpu_native.decode_attention_on_amx(fp8, bf16, 16, 9, 3, 64) == amx
    case = make_case(torch.Generator().manual_seed(5), context_lens=[37, 1, 100], q_lens=[1, 1, 1], num_heads=34,
                     num_kv_heads=2, head_dim=64, block_size=16, dtype=bf16)
    assert max_error(_run(case), dense_attention(case)) <= TOLERANCE[bf16]


@pytest.mark.parametrize("block_size", [16, 32])
def test_stale_slots_past_a_context_never_reach_the_output(block_size: int) -> None:
    """The AMX path computes whole 16-key score tiles and 32-key value steps, reading the slots
    past a context's end in its last block; NaN there (a freed block's leftovers can be anything)
    must not reach the output: their scores are dropped, their values replaced by zeros."""
    case = make_case(torch.Generator().manual_seed(block_size), context_lens=AMX_EDGE_CONTEXTS,
                     q_lens=[1] * len(AMX_EDGE_CONTEXTS), num_heads=9, num_kv_heads=3, head_dim=64,
                     block_size=block_size, dtype=torch.bfloat16)
    for seq, context in enumerate(AMX_EDGE_CONTEXTS):
        last_block = int(case.block_tables[seq, (context - 1) // block_size])
        case.k_cache[last_block, (context - 1) % block_size + 1:] = float("nan")
        case.v_cache[last_block, (context - 1) % block_size + 1:] = float("nan")
    out = _run(case)
    assert torch.isfinite(out).all()
    assert max_error(out, dense_attention(case)) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_peaked_scores_match_dense(dtype: torch.dtype) -> None:
    # Scores hundreds apart (a sharp head): the weights far below the peak are cut to exact
    # zeros rather than subnormals, and the result still matches dense attention.
    case = random_case(torch.Generator().manual_seed(11), decode=True, dtype=dtype)
    case.query.mul_(40)
    assert max_error(_run(case), dense_attention(case)) <= TOLERANCE[dtype]
