"""A step's forward pass that a more urgent arrival may give up (server/core/step_interrupt.py):
where the engine allows it, the flag checked before each decoder layer, and the forward that
arms it and takes the step back when it is given up (server/core/step_undo.py).
"""

from __future__ import annotations

from typing import Any

from kvscale.server.config import EngineConfig
from kvscale.server.core.scheduler import SchedulerOutput
from kvscale.server.core.step_interrupt import StepInterrupt, StepInterrupted, interrupt_bound
from kvscale.server.core.step_undo import StepSnapshot, undo_step, undoable
from kvscale.server.worker.model_runner import StepLogits


def interruptible_layers(config: EngineConfig, device_type: str, model: Any,
                         async_scheduling: bool) -> StepInterrupt | None:
    """The flag a forward checks before each decoder layer (a forward pre-hook), where a step can
    be given up for a more urgent arrival (step_interrupt.py): ``--scheduling-policy priority``
    on a CPU, one rank, synchronous steps without speculative decoding. None elsewhere: a GPU's
    step is short and its layers are queued ahead of the kernels, ranks would have to give up a
    step together, and an overlapped step is queued before the one in flight is read."""
    if (config.scheduling_policy != "priority" or device_type != "cpu" or config.tensor_parallel_size > 1
            or config.speculative_config is not None or async_scheduling):
        return None
    interrupt = StepInterrupt()
    for layer in getattr(model, "layers", ()):
        layer.register_forward_pre_hook(interrupt.check)
    if hasattr(model, "one_call_check"):  # layers run in C calls (server/worker/cpu_step_layers.py)
        model.one_call_check = interrupt.check
    return interrupt


def run_forward(engine: Any, sched: SchedulerOutput, snapshot: StepSnapshot | None, scheduled_at: float,
                copies: list[tuple[int, int]], copied: bool, extra_rows: list[int] | None) -> StepLogits | None:
    """The runner's forward of ``sched`` (marked scheduled at ``scheduled_at``); None when a more
    urgent arrival gave it up (step_interrupt.py), the step then taken back as if never scheduled."""
    interrupt, bound = engine.step_interrupt, None
    pool = engine.scheduler.kv.pool
    if interrupt is not None and snapshot is not None and undoable(engine.scheduler, sched, snapshot, copied):
        bound = interrupt_bound((item.seq.request.priority, item.seq.skipped_steps) for item in sched.scheduled)
    if bound is None:
        pool.registration_log = None  # kept only while a step may be taken back
        return engine.runner.execute(sched.scheduled, copies, extra_rows=extra_rows)
    assert interrupt is not None and snapshot is not None
    interrupt.arm(bound)
    try:
        interrupt.check()  # an arrival heard while the step was scheduled gives it up before it runs
        return engine.runner.execute(sched.scheduled, copies, extra_rows=extra_rows)
    except StepInterrupted:
        undo_step(engine.scheduler, sched, snapshot)
        for item in sched.scheduled:  # first scheduled by this step: not scheduled after all
            if item.seq.request.metrics.first_scheduled_time == scheduled_at:
                item.seq.request.metrics.first_scheduled_time = None
        engine.step_given_up = True
        return None
    finally:
        interrupt.disarm()
        pool.registration_log = None
