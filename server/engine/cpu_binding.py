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

The affinity mask is not what a container may use: without the kubelet's static CPU manager it
holds every CPU of the node, while the cgroup's CPU quota (``cpu.max`` on cgroup v2,
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` on v1) is the pod's limit. ``auto`` takes
min(affinity CPUs, ceil(quota), ``OMP_NUM_THREADS``) threads, and pins them only when that
budget covers the whole mask: below it, every pod on the node would pin itself to the same first
CPUs and they would all spin there (docs/deploy.md, "CPU threads"). ``split_cpus`` is the pure
decision; ``cpu_budget`` reads the cgroup and the environment for it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ENV = "KVSCALE_CPU_OMP_THREADS_BIND"
# From this many CPUs on, one is kept for the front end by default.
RESERVE_FROM = 4


@dataclass(frozen=True)
class CpuSplit:
    core: tuple[int, ...] | None  # None: leave the core's affinity and thread count alone
    front: tuple[int, ...] | None  # None: the front end keeps what it has
    why: str
    threads: int | None = None  # fewer threads than core CPUs, or a count without pinning

    @property
    def num_threads(self) -> int | None:
        if self.threads is not None:
            return self.threads
        return len(self.core) if self.core else None


def quota_from_cpu_max(text: str) -> float | None:
    """CPUs a cgroup v2 ``cpu.max`` (``"200000 100000"``, ``"max 100000"``) allows; None: no limit."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    period = int(parts[1]) if len(parts) > 1 else 100_000
    return int(parts[0]) / period if period > 0 else None


def quota_from_cfs(quota_us: str, period_us: str) -> float | None:
    """CPUs cgroup v1's ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` allow; None: no limit (-1)."""
    quota, period = int(quota_us.strip()), int(period_us.strip())
    return quota / period if quota > 0 and period > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup"),
                     self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota over this process's cgroup and its ancestors; None: unlimited or
    unknown. In a container (its own cgroup namespace) the cgroup is ``root`` itself."""
    quotas: list[float] = []
    for line in (_read(self_cgroup) or "").splitlines():
        _id, _sep, rest = line.partition(":")
        controllers, _sep, path = rest.partition(":")
        if controllers == "":  # v2: walk from the process's cgroup up to the root
            leaf = root / path.lstrip("/")
            for folder in [leaf, *leaf.parents]:
                text = _read(folder / "cpu.max")
                if text is not None and (quota := quota_from_cpu_max(text)) is not None:
                    quotas.append(quota)
                if folder == root:
                    break
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            folders = [mount / sub for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct")
                       for sub in (path.lstrip("/"), "")]
            for folder in folders:
                quota_us = _read(folder / "cpu.cfs_quota_us")
                period_us = _read(folder / "cpu.cfs_period_us")
                if quota_us is not None and period_us is not None:
                    if (quota := quota_from_cfs(quota_us, period_us)) is not None:
                        quotas.append(quota)
                    break
    return min(quotas) if quotas else None


def cpu_budget(environ: dict[str, str] | None = None, root: Path = Path("/sys/fs/cgroup"),
               self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs this process may keep busy: its cgroup quota, or fewer when ``OMP_NUM_THREADS`` says
    so (the operator sets it on CPU pods from their CPU request); None: no bound but the mask."""
    environ = dict(os.environ) if environ is None else environ
    bounds = [q for q in (cgroup_cpu_quota(root, self_cgroup),) if q is not None]
    omp = (environ.get("OMP_NUM_THREADS") or "").strip()
    if omp.isdigit() and int(omp) >= 1:
        bounds.append(float(omp))
    return min(bounds) if bounds else None


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


def split_cpus(allowed: set[int] | frozenset[int], spec: str,
               budget: float | None | Literal["read"] = "read") -> CpuSplit:
    """The split for a process allowed on ``allowed`` CPUs, a flag value ``spec`` and a CPU
    ``budget`` (its quota; None: none; "read": ``cpu_budget()``, this process's own)."""
    if budget == "read":
        budget = cpu_budget()
    cpus = tuple(sorted(allowed))
    spec = spec.strip() or "auto"
    limit = max(1, math.ceil(budget - 1e-9)) if budget is not None else None
    if spec == "nobind":
        return CpuSplit(None, None, "nobind: no affinity set")
    if spec == "auto":
        if limit is not None and limit < len(cpus):
            threads = limit - 1 if limit >= RESERVE_FROM else limit
            return CpuSplit(None, None, f"auto: a CPU budget of {budget:g} below the {len(cpus)} CPUs "
                            f"allowed, {threads} threads, not pinned", threads=threads)
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
    # The CPUs named, but no more threads than the budget keeps busy.
    capped = limit if limit is not None and limit < len(chosen) else None
    if not rest:
        return CpuSplit(chosen, None, f"{spec}: every CPU to the core, the front end shares them",
                        capped)
    return CpuSplit(chosen, rest, f"{spec}: the front end keeps {','.join(map(str, rest))}", capped)
