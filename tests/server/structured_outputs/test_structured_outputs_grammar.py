"""The grammar layer without a server: every test instance of the shared sample fed token by
token through the matcher (a dropped or weakened constraint accepts an invalid instance), refusals
naming the keyword, bounded whitespace, the compile cache and time limit, and the batch mask."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from bench.json_key_order import compact, judged_valid
from bench.jsonschemabench import load_rows
from kvscale.server.sampling_params import StructuredOutputsParams
from kvscale.server.structured_outputs import backend
from kvscale.server.structured_outputs.compile_pool import CompilePool
from kvscale.server.structured_outputs.compiler import (
    Compiled,
    GrammarCompiler,
    GrammarFailure,
    StructuredOutputsConfig,
)
from kvscale.server.structured_outputs.manager import mask_rows_inplace, unpack

VOCAB = 49152
EOS = {0, 2}


@pytest.fixture(scope="module")
def lltokenizer(bundled_tokenizer):
    return backend.build_tokenizer(bundled_tokenizer, VOCAB, EOS)


def compile_json(lltokenizer, schema) -> object:
    spec = StructuredOutputsParams(json=json.dumps(schema, separators=(",", ":")))
    return backend.compile_grammar(lltokenizer, backend.grammar_text(spec))


def accepts(compiled, ids: list[int]) -> bool:
    matcher = backend.Matcher.of(compiled)
    return all(matcher.consume(token) for token in ids) and matcher.is_accepting()


def test_every_test_instance_of_the_sample_is_judged_as_the_schema_judges_it(lltokenizer, bundled_tokenizer):
    """Valid instances accepted (in some key order: grammar_helpers.py), invalid ones rejected."""

    def encode(text: str) -> list[int]:
        return bundled_tokenizer(text, add_special_tokens=False)["input_ids"]

    rows = [row for row in load_rows() if row.get("tests")]
    assert len(rows) > 250
    checked = refused = 0
    wrong: list[str] = []
    for row in rows:
        try:
            compiled = compile_json(lltokenizer, row["schema"])
        except backend.GrammarError as exc:
            # A refusal is allowed (the server answers 400), but it must say what it cannot do.
            assert str(exc), row["id"]
            refused += 1
            continue
        for test in row["tests"]:
            checked += 1
            if not judged_valid(compiled, encode, test["data"], row["schema"], test["valid"]):
                wrong.append(f"{row['id']}: valid={test['valid']} {compact(test['data'])[:80]}")
    assert not wrong, wrong[:10]
    assert checked > 950 and refused < len(rows) // 8, (checked, refused)


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
])
def test_a_schema_that_cannot_be_enforced_exactly_is_refused_naming_the_keyword(lltokenizer, schema, keyword):
    with pytest.raises(backend.GrammarError, match=keyword):
        compile_json(lltokenizer, schema)


def test_the_tokenizer_free_check_refuses_exactly_what_the_compile_refuses(lltokenizer):
    """``schema_refusal`` (used where auto tool choice picks a tool's constraint, before any
    tokenizer) agrees with the compile on every schema of the sample; annotations, which assert
    nothing, pass as they are."""
    for row in load_rows():
        try:
            compile_json(lltokenizer, row["schema"])
            compiled = True
        except backend.GrammarError:
            compiled = False
        assert (backend.schema_refusal(row["schema"]) is None) == compiled, row["id"]
    annotated = {"type": "object", "title": "t", "description": "d", "$comment": "c", "examples": [{}],
                 "default": {}, "deprecated": True, "readOnly": True, "writeOnly": False,
                 "properties": {"x": {"type": "string", "contentMediaType": "text/plain",
                                      "contentEncoding": "base64"}}}
    assert backend.schema_refusal(annotated) is None
    assert "uniqueItems" in (backend.schema_refusal({"type": "array", "uniqueItems": True}) or "")


def test_constraints_beside_each_other_are_all_enforced(lltokenizer, bundled_tokenizer):
    """maxLength beside pattern, minItems/maxItems (constraints other engines drop)."""
    compiled = compile_json(lltokenizer, {"type": "object", "properties": {
        "s": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
        "a": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}},
        "required": ["s", "a"], "additionalProperties": False})

    def ok(text: str) -> bool:
        return accepts(compiled, bundled_tokenizer(text, add_special_tokens=False)["input_ids"])

    assert ok('{"s":"abc","a":[1]}')
    assert not ok('{"s":"abcd","a":[1]}')
    assert not ok('{"s":"ab1","a":[1]}')
    assert not ok('{"s":"ab","a":[]}')
    assert not ok('{"s":"ab","a":[1,2,3]}')


def test_whitespace_between_tokens_is_bounded(lltokenizer, bundled_tokenizer):
    compiled = compile_json(lltokenizer, {"type": "object", "properties": {"a": {"type": "integer"}}})

    def ok(text: str) -> bool:
        return accepts(compiled, bundled_tokenizer(text, add_special_tokens=False)["input_ids"])

    assert ok('{"a":1}') and ok('{"a": 1}') and ok('{\n  "a": 1\n}')
    assert not ok('{"a":  1}')  # two spaces
    assert not ok('{\n\n"a":1}')
    assert not ok("{" + "\n" + " " * 17 + '"a":1}')


def test_a_complete_grammar_stops_and_a_fork_keeps_its_own_state(lltokenizer, bundled_tokenizer):
    compiled = backend.compile_grammar(lltokenizer, backend.grammar_text(StructuredOutputsParams(choice=["yes", "no"])))
    parent = backend.Matcher.of(compiled)
    child = parent.copy()
    yes = bundled_tokenizer("yes", add_special_tokens=False)["input_ids"]
    assert all(parent.consume(t) for t in yes) and parent.is_stopped()
    assert not child.is_stopped()
    no = bundled_tokenizer("no", add_special_tokens=False)["input_ids"]
    assert all(child.consume(t) for t in no) and child.is_stopped()


# A grammar that takes longer than the limits below: hundreds of object branches.
SLOW_SCHEMA = {"anyOf": [{"type": "object", "properties": {
    f"k{j}": {"type": "integer", "minimum": j, "maximum": j * 1000 + 7} for j in range(i, i + 30)},
    "required": [f"k{i}"]} for i in range(200)]}


# Five branches: about 0.01 s of CPU time (SmolLM2's tokenizer, idle Xeon).
SMALL_SCHEMA = {"anyOf": SLOW_SCHEMA["anyOf"][:5]}
LIMIT = StructuredOutputsConfig(compile_timeout_s=0.2)


def poll_until_answered(pending, config: StructuredOutputsConfig) -> Compiled | GrammarFailure:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        result = pending.poll(time.monotonic(), config)
        if result is not None:
            return result
        time.sleep(0.01)
    raise AssertionError("no answer in 60 s")


def test_the_cache_serves_a_second_identical_request_and_failures_name_the_time_limit(bundled_tokenizer):
    compiler = GrammarCompiler(bundled_tokenizer, VOCAB, EOS, LIMIT)
    try:
        spec = StructuredOutputsParams(json='{"type":"object"}')
        first = compiler.submit(spec)
        first.future.result(timeout=60)
        second = compiler.submit(StructuredOutputsParams(json='{"type":"object"}'))
        assert second.cache_hit and compiler.cache_hits == 1
        pending = compiler.submit(StructuredOutputsParams(json=json.dumps(SLOW_SCHEMA)))
        result = poll_until_answered(pending, LIMIT)
        assert isinstance(result, GrammarFailure) and result.reason == "timeout", result
        assert "limit of 0.2 s of CPU time" in result.message and "compile_timeout_s" in result.message
    finally:
        compiler.shutdown()


def test_a_compile_over_the_limit_is_refused_even_when_first_looked_at_after_it_finished(bundled_tokenizer):
    """The engine looks at a compile between two steps; under load one step can outlast a whole
    compile. The limit must not depend on that: a compile that took longer than the limit fails
    its request however late it is looked at, and the retry is served from the cache."""
    compiler = GrammarCompiler(bundled_tokenizer, VOCAB, EOS, LIMIT)
    try:
        spec = StructuredOutputsParams(json=json.dumps(SLOW_SCHEMA))
        pending = compiler.submit(spec)
        assert pending.future.result(timeout=60).cpu_seconds >= 0.2  # the loop never looked meanwhile
        result = pending.poll(time.monotonic(), LIMIT)
        assert isinstance(result, GrammarFailure) and "limit of 0.2 s" in result.message
        retry = compiler.submit(spec)
        assert retry.cache_hit and isinstance(retry.poll(time.monotonic(), LIMIT), Compiled)
    finally:
        compiler.shutdown()


@contextmanager
def gil_starved(hold_s: float) -> Iterator[None]:
    """Starves every other thread of this process that runs Python: a busy thread holds the GIL
    for ``hold_s`` at a time, so a compile worker waits that long each time it needs it (after the
    library's native compile, at least) while its CPU clock stands still; a scheduler that gives
    a low-priority compile no core does the same to it, without a test's control over how long."""
    stop = threading.Event()

    def hold() -> None:
        while not stop.is_set():
            pass

    switch = sys.getswitchinterval()
    sys.setswitchinterval(hold_s)
    holder = threading.Thread(target=hold)
    holder.start()
    try:
        yield
    finally:
        stop.set()
        holder.join()
        sys.setswitchinterval(switch)


def test_a_compile_starved_past_the_limit_in_wall_time_but_not_in_its_own_cpu_time_succeeds(bundled_tokenizer):
    """The limit counts the compile's own CPU time: compile threads run at the lowest priority,
    so a busy engine starves them, and time the compile never got must not fail it."""
    compiler = GrammarCompiler(bundled_tokenizer, VOCAB, EOS, LIMIT)
    try:
        compiler.submit(StructuredOutputsParams(json='{"type":"object"}')).future.result(timeout=60)  # tokenizer
        with gil_starved(0.5):
            pending = compiler.submit(StructuredOutputsParams(json=json.dumps(SMALL_SCHEMA)))
            done = pending.future.result(timeout=60)
        assert done.seconds > 0.2 > done.cpu_seconds, done  # starved past the limit's value, under it in CPU
        result = pending.poll(time.monotonic(), LIMIT)
        assert isinstance(result, Compiled), result
    finally:
        compiler.shutdown()


def test_a_compile_starved_while_it_runs_is_not_refused_on_the_way(bundled_tokenizer):
    """Looked at while it runs (the engine polls between steps), a starved compile is judged by
    the CPU time it has had so far, not by the wall-clock time since it started."""
    compiler = GrammarCompiler(bundled_tokenizer, VOCAB, EOS, LIMIT)
    answers: list[Compiled | GrammarFailure] = []
    try:
        compiler.submit(StructuredOutputsParams(json='{"type":"object"}')).future.result(timeout=60)
        with gil_starved(0.5):
            pending = compiler.submit(StructuredOutputsParams(json=json.dumps(SMALL_SCHEMA)))
            while not pending.future.done():
                answer = pending.poll(time.monotonic(), LIMIT)
                if answer is not None:
                    answers.append(answer)
                    break
                time.sleep(0.01)
        assert not answers, answers
        assert time.monotonic() - pending.job.started > 0.2
        assert isinstance(pending.poll(time.monotonic(), LIMIT), Compiled)
    finally:
        compiler.shutdown()


def test_a_request_that_waits_past_the_wall_clock_bound_gets_the_bound_and_the_retry_is_cached(bundled_tokenizer):
    """Queued behind a long compile on the one worker (the same wait a starved compile makes),
    a request gets the wall-clock bound's message once it has waited that long; its compile
    goes on and the retry is served from the cache."""
    # The wait bound well under the slow compile (~0.5 s of CPU on an AVX2 EPYC, ~0.3 s on a Zen 5),
    # so that compile is still running when the queued request's bound ends.
    config = StructuredOutputsConfig(compile_timeout_s=0.1, compile_wait_timeout_s=0.1)
    compiler = GrammarCompiler(bundled_tokenizer, VOCAB, EOS, config)
    try:
        compiler.submit(StructuredOutputsParams(json='{"type":"object"}')).future.result(timeout=60)
        slow = compiler.submit(StructuredOutputsParams(json=json.dumps(SLOW_SCHEMA)))
        spec = StructuredOutputsParams(json=json.dumps(SMALL_SCHEMA))
        queued = compiler.submit(spec)
        result = poll_until_answered(queued, config)
        assert isinstance(result, GrammarFailure) and result.reason == "wait_timeout", result
        assert "limit of 0.1 s" in result.message and "compile_wait_timeout_s" in result.message
        assert not slow.future.done()  # still ahead of it: the wait was the queue's
        queued.future.result(timeout=60)
        retry = compiler.submit(spec)
        assert retry.cache_hit and isinstance(retry.poll(time.monotonic(), config), Compiled)
    finally:
        compiler.shutdown()


def test_compile_workers_run_at_the_lowest_priority_by_default_and_still_compile(bundled_tokenizer):
    compiler = GrammarCompiler(bundled_tokenizer, VOCAB, EOS, StructuredOutputsConfig())
    try:
        pending = compiler.submit(StructuredOutputsParams(json=json.dumps(SMALL_SCHEMA)))
        assert isinstance(poll_until_answered(pending, compiler.config), Compiled)
        worker = compiler.pool.threads[0].native_id  # lowered itself before it took the job
        assert worker is not None and os.sched_getscheduler(worker) == os.SCHED_IDLE
    finally:
        compiler.shutdown()


def test_what_every_compile_needs_is_built_once_at_the_pool_creators_priority_not_a_workers():
    """The tokenizer's build holds the GIL for its whole time (~0.2 s): a SCHED_IDLE worker
    preempted inside it would stall every thread of the process, the engine's included. It is
    built once, for the first job, by a thread at the priority of the thread that made the pool;
    the workers still compile at theirs. A pool that is never given a job never builds it."""
    built: list[tuple[int, int]] = []

    def prepare() -> tuple[int, int]:
        tid = threading.get_native_id()
        built.append((os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)))
        return built[-1]

    here = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    pool = CompilePool(prepare, lambda prepared, arg: (prepared, threading.get_native_id()), workers=1,
                       priority="idle", starved_after_s=60)
    try:
        time.sleep(0.2)
        assert built == []
        results = [pool.submit(i).future.result(timeout=30).template for i in range(3)]
        assert built == [here] and all(prepared == here for prepared, _ in results)
        assert {os.sched_getscheduler(worker) for _, worker in results} == {os.SCHED_IDLE}
    finally:
        pool.shutdown()


def test_workers_waiting_for_the_build_are_not_taken_for_starved_ones():
    """A build longer than compile_starved_after_s (a loaded node): the worker waits for it, using
    no CPU, and the engine is idle; the rescuer would only wait for the same build."""
    def prepare() -> str:
        time.sleep(1.0)
        return "built"

    pool = CompilePool(prepare, lambda prepared, arg: prepared, workers=1, priority="idle", starved_after_s=0.2)
    try:
        assert pool.submit(0).future.result(timeout=30).template == "built"
        assert pool.rescues == 0
    finally:
        pool.shutdown()


def test_a_build_that_fails_fails_every_job_with_its_error():
    def prepare() -> None:
        raise OSError("tokenizer.json unreadable")

    pool = CompilePool(prepare, lambda prepared, arg: arg, workers=1, priority="idle", starved_after_s=60)
    try:
        for arg in range(2):
            with pytest.raises(OSError, match="unreadable"):
                pool.submit(arg).future.result(timeout=30)
    finally:
        pool.shutdown()


@contextmanager
def starved_worker(compiler: GrammarCompiler) -> Iterator[None]:
    """Processes at a normal priority leave a SCHED_IDLE worker next to nothing: the worker on
    one CPU with eight busy loops, far under STARVED_SHARE. The rescuer is left free to run on
    any CPU."""
    cpu = min(os.sched_getaffinity(0))
    worker = compiler.pool.threads[0].native_id
    assert worker is not None
    os.sched_setaffinity(worker, {cpu})
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             preexec_fn=lambda: os.sched_setaffinity(0, {cpu})) for _ in range(8)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


# ~0.1 s of CPU time: the starved worker alone would take several seconds over it.
MEDIUM_SCHEMA = {"anyOf": SLOW_SCHEMA["anyOf"][:60]}
# The rescue tests are about who compiles, not the time limit: the default limit, far above the
# medium schema's CPU time (under a loaded make test, 0.2 s was once too little).
RESCUE = StructuredOutputsConfig(compile_starved_after_s=0.3)


def test_a_worker_starved_while_the_engine_is_idle_is_rescued_at_the_process_priority(bundled_tokenizer):
    config = RESCUE
    compiler = GrammarCompiler(bundled_tokenizer, VOCAB, EOS, config)
    try:
        compiler.submit(StructuredOutputsParams(json='{"type":"object"}')).future.result(timeout=60)  # tokenizer
        with starved_worker(compiler):
            pending = compiler.submit(StructuredOutputsParams(json=json.dumps(MEDIUM_SCHEMA)))
            result = poll_until_answered(pending, config)
        assert isinstance(result, Compiled), result
        assert compiler.pool.rescues >= 1
    finally:
        compiler.shutdown()


def rescued_only_once_the_engine_stops(bundled_tokenizer, engine: Callable[[CompilePool, threading.Event,
                                                                           threading.Event], None]) -> None:
    """With the worker starved and ``engine(pool, in_pass, stop)`` on a thread of its own (it sets
    ``in_pass`` once inside its first pass): no rescue for five times compile_starved_after_s;
    once ``stop`` is set and the thread ends, the rescuer compiles."""
    config = RESCUE
    compiler = GrammarCompiler(bundled_tokenizer, VOCAB, EOS, config)
    in_pass, stop = threading.Event(), threading.Event()
    steps = threading.Thread(target=engine, args=(compiler.pool, in_pass, stop))
    try:
        compiler.submit(StructuredOutputsParams(json='{"type":"object"}')).future.result(timeout=60)
        # On a loaded machine the warm-up (the tokenizer's build) may itself have been rescued.
        rescued = compiler.pool.rescues
        with starved_worker(compiler):
            steps.start()
            assert in_pass.wait(10)
            pending = compiler.submit(StructuredOutputsParams(json=json.dumps(MEDIUM_SCHEMA)))
            time.sleep(1.5)  # five times compile_starved_after_s
            assert compiler.pool.rescues == rescued and not pending.future.done()
            stop.set()
            steps.join()
            result = poll_until_answered(pending, config)
        assert isinstance(result, Compiled), result
        assert compiler.pool.rescues > rescued
    finally:
        stop.set()
        compiler.shutdown()


def test_a_worker_starved_while_the_engine_runs_forward_passes_waits_for_the_engine(bundled_tokenizer):
    """Compiles yield to the engine by design: while it runs forward passes, no rescue; once it
    stops, the rescuer steps in."""

    def engine(pool: CompilePool, in_pass: threading.Event, stop: threading.Event) -> None:
        # The thread may wait for the interpreter lock on its way out of a pass (the starved
        # worker can hold it for a while): that time counts as the pass's, as it does for the
        # engine's own thread.
        while not stop.is_set():
            with pool.forward_running():
                in_pass.set()
                stop.wait(0.02)

    rescued_only_once_the_engine_stops(bundled_tokenizer, engine)


def test_a_forward_pass_longer_than_the_starved_bound_is_not_taken_for_an_idle_engine(bundled_tokenizer):
    """One pass (a long prefill chunk) may outlast compile_starved_after_s: the engine is busy all
    along, though it last started a pass before the workers were seen starving."""

    def engine(pool: CompilePool, in_pass: threading.Event, stop: threading.Event) -> None:
        with pool.forward_running():
            in_pass.set()
            stop.wait(60)

    rescued_only_once_the_engine_stops(bundled_tokenizer, engine)


def test_the_wait_bound_may_not_be_below_the_cpu_time_limit():
    with pytest.raises(ValueError, match="compile_wait_timeout_s"):
        StructuredOutputsConfig(compile_timeout_s=5, compile_wait_timeout_s=1)
    with pytest.raises(ValueError, match="compile_priority"):
        StructuredOutputsConfig(compile_priority="realtime")


def test_the_batch_mask_sets_exactly_the_disallowed_tokens_to_minus_infinity():
    rng = np.random.default_rng(0)
    for density in (0.001, 0.5, 0.999):
        bits = (rng.random((3, 4096)) < density).astype(np.uint8)
        words = torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())
        assert (unpack(words) == bits).all()
        logits = torch.randn(3, 4096)
        masked = logits.clone()
        mask_rows_inplace(masked.numpy(), unpack(words))
        expected = torch.where(torch.from_numpy(bits.astype(bool)), logits, torch.tensor(float("-inf")))
        assert torch.equal(masked, expected)
