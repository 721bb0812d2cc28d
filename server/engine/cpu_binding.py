"""Which CPUs the engine core's OpenMP threads get, and which the HTTP front end keeps.

The core runs the model: its OpenMP pool spins at barriers, so a thread preempted by the front
end (HTTP parsing, tokenizing, streaming) stalls all the others until it runs again. With enough
cores the front end gets one of its own and the core one thread on each of the rest; with few
cores a reserved core would cost more compute than the contention does, so both share them.

``--omp-threads-bind`` (env ``KVSCALE_CPU_OMP_THREADS_BIND``, after vLLM's
``VLLM_CPU_OMP_THREADS_BIND``): ``auto`` (the rule above), ``nobind`` (no affinity, torch's own
thread count), or a CPU list such as ``0-2`` or ``0,2,4``: the core's CPUs, the front end keeping
the others (every CPU, when the list holds all of them). An explicit ``OMP_NUM_THREADS`` caps the
core's thread count.
"""

from __future__ import annotations

from dataclasses import dataclass

ENV = "KVSCALE_CPU_OMP_THREADS_BIND"
# From this many CPUs on, one is kept for the front end by default.
RESERVE_FROM = 4


@dataclass(frozen=True)
class CpuSplit:
    core: tuple[int, ...] | None  # None: leave the core's affinity and thread count alone
    front: tuple[int, ...] | None  # None: the front end keeps what it has
    why: str

    @property
    def num_threads(self) -> int | None:
        return len(self.core) if self.core else None


def core_threads(split: CpuSplit, omp_num_threads: str | None) -> int | None:
    """The core's torch thread count: one per CPU it got, fewer when ``OMP_NUM_THREADS`` says so
    (a user, or a test running several servers on few cores); None: torch's own choice."""
    wanted = split.num_threads
    if omp_num_threads and omp_num_threads.strip().isdigit() and int(omp_num_threads) >= 1:
        explicit = int(omp_num_threads)
        return min(explicit, wanted) if wanted else explicit
    return wanted


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``0-2,5`` -> (0, 1, 2, 5); raises ValueError on anything else."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty entry in CPU list {text!r}")
        first, dash, last = part.partition("-")
        low, high = int(first), int(last) if dash else int(first)
        if low < 0 or high < low:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.extend(range(low, high + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"CPU list {text!r} names a CPU twice")
    return tuple(cpus)


def split_cpus(allowed: set[int] | frozenset[int], spec: str) -> CpuSplit:
    """The split for a process allowed on ``allowed`` CPUs and a flag value ``spec``."""
    cpus = tuple(sorted(allowed))
    spec = spec.strip() or "auto"
    if spec == "nobind":
        return CpuSplit(None, None, "nobind: no affinity set")
    if spec == "auto":
        if len(cpus) >= RESERVE_FROM:
            return CpuSplit(cpus[:-1], cpus[-1:],
                            f"auto: {len(cpus)} CPUs, one kept for the HTTP front end")
        return CpuSplit(cpus, None, f"auto: only {len(cpus)} CPU(s), the front end shares them")
    chosen = parse_cpu_list(spec)
    outside = [cpu for cpu in chosen if cpu not in allowed]
    if outside:
        raise ValueError(f"--omp-threads-bind {spec}: CPUs {outside} are not among this process's "
                         f"allowed CPUs {list(cpus)}")
    rest = tuple(cpu for cpu in cpus if cpu not in chosen)
    if not rest:
        return CpuSplit(chosen, None, f"{spec}: every CPU to the core, the front end shares them")
    return CpuSplit(chosen, rest, f"{spec}: the front end keeps {','.join(map(str, rest))}")
