"""How peak memory is read: one interface, three implementations (CUDA, CPU, fake; the fourth, on fake tensors, is
paper_meter.py); and how a number of bytes is written (`format_bytes`, the one byte formatter).

A meter runs a callable once and reports the peak memory it reached, including what was already live
when it started (weights, optimizer state), so every implementation answers the same question: "how
much memory does this process need to run this step?".

* :class:`CudaMeter` reads the caching allocator's peak counters and the driver's view (nvidia-ml-py).
* :class:`CpuMeter` replays the profiler's allocation events: exact to the byte and repeatable, unlike
  RSS, which depends on what glibc kept from earlier steps.
* :class:`FakeMeter` takes memory from a formula, so the search is unit-tested to the exact sizes tried.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..compat import parallel, torch_features

MiB = 1 << 20
GiB = 1 << 30


def format_bytes(n: float | None, unit: str | None = None, none: str = "?") -> str:
    """The one way hf_accum writes a number of bytes: "1.860 GiB" from 1 GiB up, "64.0 MiB" below (``none`` for
    an unknown). ``unit="MiB"``: the number alone in MiB ("1,234.5"), for a table column whose header names it."""
    if n is None:
        return none
    if unit == "MiB":
        return f"{n / MiB:,.1f}"
    return f"{n / GiB:.3f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"

# The CUDA caching allocator serves requests of 1-10 MiB from fresh 20 MiB segments (``kLargeBuffer`` in
# c10/cuda/CUDACachingAllocator.cpp) and rounds larger ones to 2 MiB; so reserved memory grows in steps of
# up to 20 MiB that a line through earlier trials cannot see.  That step is the CUDA rounding bound.
CUDA_SEGMENT_BYTES = 20 * MiB


@dataclass(frozen=True)
class Measurement:
    """One measured run.

    ``peak_bytes``: peak tensor memory during the run, including what was live at its start.
    ``reserved_bytes``: peak memory the allocator held from the device (CUDA), None where there is none.
    ``baseline_bytes``: tensor memory live when the run started.
    ``rounding_bytes``: the meter's bound on what the allocator may add beyond the reported numbers.
    """

    peak_bytes: int
    reserved_bytes: int | None
    seconds: float
    baseline_bytes: int = 0
    rounding_bytes: int = 0

    @property
    def charged_bytes(self) -> int:
        """What a budget is compared with: reserved memory where known (what an OOM is decided on)."""
        return self.reserved_bytes if self.reserved_bytes is not None else self.peak_bytes


class Meter(ABC):
    """Measures one call's peak memory and knows its device's capacity."""

    name: str = "meter"
    #: True when running out of memory raises an exception the probe can catch (CUDA, fake).  On CPU the
    #: kernel's OOM killer ends the process instead, so the probe never runs a size predicted to exceed
    #: the capacity there.
    catches_oom: bool = True
    #: False when a step's wall time says nothing about the device (the estimate's steps on fake tensors): the
    #: probe's progress lines leave the seconds out, as its table does.
    times_steps: bool = True

    @abstractmethod
    def measure(self, fn: Callable[[], Any], *, micro_batch_size: int | None = None) -> Measurement:
        """Run ``fn()`` once and report its peak memory.  ``micro_batch_size`` is only read by fakes."""

    @abstractmethod
    def capacity_bytes(self) -> int:
        """Total memory of the device this meter watches (GPU memory; RAM or the cgroup limit)."""

    def unavailable_bytes(self) -> int:
        """Memory of the device this process cannot use: other processes, the CUDA context, libraries."""
        return 0

    def describe(self) -> dict[str, Any]:
        """Facts for a report or a plan's cache key."""
        return {"meter": self.name, "capacity_bytes": self.capacity_bytes()}

    def time(self, fn: Callable[[], Any], *, micro_batch_size: int | None = None) -> float:
        """Wall seconds of one ``fn()`` without measuring memory (no profiler, warm allocator caches):
        the warm-up and the throughput mode time with this."""
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


# --- tensors held before a step ------------------------------------------------------------------------
def live_tensor_bytes(*holders: Any, device_type: str | None = "cpu") -> int:
    """Bytes of the distinct storages held by modules (parameters, gradients, buffers), optimizers
    (their state) and tensors, counting a storage shared by several tensors once.

    This is what a profiler started just before a step cannot see: it was allocated earlier.
    """
    seen: set[tuple[str, int]] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor):
            return
        t = parallel.local_shard(t)  # a sharded (DTensor) parameter, gradient or state holds only its shard here
        if device_type is not None and t.device.type != device_type:
            return
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.data_ptr() == 0 or key in seen:
            return
        seen.add(key)
        total += storage.nbytes()

    for holder in holders:
        if isinstance(holder, torch.nn.Module):
            for p in holder.parameters():
                add(p)
                add(p.grad)
            for b in holder.buffers():
                add(b)
        elif isinstance(holder, torch.optim.Optimizer):
            for state in holder.state.values():
                for value in state.values():
                    add(value)
            for group in holder.param_groups:
                for p in group["params"]:
                    add(p)
                    add(p.grad)
        elif isinstance(holder, torch.Tensor):
            add(holder)
        elif isinstance(holder, Iterable):
            for item in holder:
                add(item)
    return total


def all_live_tensor_bytes(device_type: str | None = "cpu") -> int:
    """Bytes of every tensor the Python heap holds: what an engine keeps in structures of its own (DeepSpeed's
    flat partitions and optimizer state), which no list of modules and optimizers reaches."""
    tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]  # type(): no deprecated proxies
    return live_tensor_bytes(tensors, device_type=device_type)


# --- CPU ---------------------------------------------------------------------------------------------------
_CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _cgroup_limit_bytes(paths: Iterable[str] = _CGROUP_LIMIT_FILES) -> int | None:
    """The memory limit of this process's cgroup (v2, then v1); None when unlimited or not found."""
    for path in paths:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text == "max":
            return None
        value = int(text)
        # v1 reports "unlimited" as a page-aligned 2**63 - 1; anything above physical RAM means no limit.
        return value if value < (1 << 62) else None
    return None


def _cgroup_usage_bytes() -> int | None:
    """Memory charged to this process's cgroup now (v2, then v1); None when not found."""
    for path in ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"):
        try:
            with open(path) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            continue
    return None


class CpuMeter(Meter):
    """Exact peak tensor memory of a CPU step from the profiler's allocation events.

    ``torch.profiler.profile(profile_memory=True)`` records every allocation and free of the CPU
    allocator as a ``[memory]`` event carrying a signed byte count.  The public ``prof.events()`` keeps
    only the ones attributed to an operator (most allocations of a training step are not), so the raw
    kineto results are read instead and replayed in time order; the running maximum is the peak.  The
    counts are the bytes requested, so the same step gives the same peak to the byte.

    Tensors allocated before the step (weights, gradients, optimizer state) produce no events, not even
    when they are freed during it (torch warns once: "Memory block of unknown size was allocated before
    the profiling started"); ``resident`` returns their bytes (see :func:`live_tensor_bytes`) and is
    added as the baseline.  A resident tensor freed mid-step is therefore still counted after its free:
    the error is on the safe side, and the probe's step keeps its gradients (zeroed, not freed) anyway.
    """

    name = "cpu"
    catches_oom = False

    def __init__(self, resident: Callable[[], int] | None = None) -> None:
        self.resident = resident
        self.page_bytes = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def measure(self, fn: Callable[[], Any], *, micro_batch_size: int | None = None) -> Measurement:
        from torch.profiler import ProfilerActivity, profile

        baseline = int(self.resident()) if self.resident is not None else 0
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
        with _quiet_native_stderr():
            prof.start()
        try:
            start = time.perf_counter()
            fn()
            seconds = time.perf_counter() - start
        finally:
            with _quiet_native_stderr():
                prof.stop()
        delta, live_blocks = replay_memory_events(prof)
        # glibc serves large blocks with mmap, rounded up to a page; each block live at the peak can thus
        # hold up to one page more than requested.  That is the rounding bound the search keeps free.
        return Measurement(
            peak_bytes=baseline + delta,
            reserved_bytes=None,
            seconds=seconds,
            baseline_bytes=baseline,
            rounding_bytes=live_blocks * self.page_bytes,
        )

    def capacity_bytes(self) -> int:
        import psutil

        total = psutil.virtual_memory().total
        limit = _cgroup_limit_bytes()
        return min(total, limit) if limit is not None else total

    def unavailable_bytes(self) -> int:
        """RAM held by everything but this process: on the machine, and inside its cgroup when limited."""
        import psutil

        own = psutil.Process().memory_info().rss
        held = self.capacity_bytes() - psutil.virtual_memory().available - own
        usage = _cgroup_usage_bytes()
        if usage is not None and _cgroup_limit_bytes() is not None:
            held = max(held, usage - own)
        return max(0, held)

    def describe(self) -> dict[str, Any]:
        import platform

        return {**super().describe(), "device": f"cpu ({platform.processor() or platform.machine()})"}


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Silence file descriptor 2 while the profiler starts or stops.

    Kineto prints five INFO lines per profiling session from C++ ("STAGE: Completed Stage: Warm Up",
    "profiler_start", ...); a probe runs a dozen sessions.  Its ``KINETO_LOG_LEVEL`` is read once, when
    torch is imported, so it cannot be set from here.  Only the start and stop calls are wrapped: errors
    and warnings of the measured step itself still reach the terminal.
    """
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to redirect (a daemon): nothing to silence
        yield
        return
    sys.stderr.flush()
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def replay_memory_events(prof: Any) -> tuple[int, int]:
    """Peak of the running sum of CPU ``[memory]`` events of a finished profiler, and blocks live then.

    The peak is relative to the start of profiling (never below 0: the start itself is a candidate).
    Frees of blocks allocated before profiling are not recorded (see :class:`CpuMeter`).
    """
    from torch.profiler import DeviceType

    events = [
        e for e in torch_features.kineto_events(prof) if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    events.sort(key=lambda e: e.start_ns())
    current = peak = blocks = peak_blocks = 0
    for e in events:
        n = e.nbytes()
        current += n
        blocks += 1 if n > 0 else -1 if n < 0 else 0
        if current > peak:
            peak, peak_blocks = current, blocks
    return peak, max(peak_blocks, 0)


# --- CUDA --------------------------------------------------------------------------------------------------
class CudaMeter(Meter):
    """Peak allocated and reserved memory of a CUDA step from the caching allocator's counters.

    Importing this module on a CPU machine is fine; constructing the meter needs a CUDA device.
    Capacity and the memory this process cannot use come from the driver: ``torch.cuda.mem_get_info``
    and, where nvidia-ml-py finds the device, NVML's per-process accounting (other processes, and this
    process's CUDA context and libraries, which torch's counters do not include).
    """

    name = "cuda"
    catches_oom = True

    def __init__(self, device: int | str | torch.device | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaMeter needs a CUDA device; use CpuMeter on this machine")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def measure(self, fn: Callable[[], Any], *, micro_batch_size: int | None = None) -> Measurement:
        from ..window.oom import free_memory

        free_memory()  # drop the previous trial's cached segments: reserved must reflect this run only
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        return Measurement(
            peak_bytes=torch.cuda.max_memory_allocated(self.device),
            reserved_bytes=torch.cuda.max_memory_reserved(self.device),
            seconds=seconds,
            baseline_bytes=baseline,
            rounding_bytes=CUDA_SEGMENT_BYTES,
        )

    def time(self, fn: Callable[[], Any], *, micro_batch_size: int | None = None) -> float:
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def capacity_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1]

    def unavailable_bytes(self) -> int:
        """Device memory in use that torch's allocator does not hold: other processes, CUDA context,
        cuBLAS/cuDNN workspaces.  ``total - free`` is everything in use; torch's reserved part is ours."""
        free, total = torch.cuda.mem_get_info(self.device)
        return max(0, total - free - torch.cuda.memory_reserved(self.device))

    def nvml_usage(self) -> dict[str, int] | None:
        """Per-process view from NVML: ``{"this_process": bytes, "other_processes": bytes}``, or None
        when NVML is not usable (no driver library, a container without process accounting)."""
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            try:
                index = self.device.index or 0
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                if visible and visible.split(",")[index].strip().isdigit():
                    index = int(visible.split(",")[index])
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                mine = sum(p.usedGpuMemory or 0 for p in procs if p.pid == os.getpid())
                others = sum(p.usedGpuMemory or 0 for p in procs if p.pid != os.getpid())
                return {"this_process": int(mine), "other_processes": int(others)}
            finally:
                pynvml.nvmlShutdown()
        except Exception:  # NVML errors are facts we cannot get, never a reason to stop a probe
            return None

    def describe(self) -> dict[str, Any]:
        info = {**super().describe(), "device": torch.cuda.get_device_name(self.device)}
        usage = self.nvml_usage()
        if usage is not None:
            info.update(usage)
            info["non_torch_bytes"] = max(0, usage["this_process"] - torch.cuda.memory_reserved(self.device))
        info["unavailable_bytes"] = self.unavailable_bytes()
        return info


# --- fake ----------------------------------------------------------------------------------------------------
class FakeMeter(Meter):
    """Memory from a formula of the micro-batch size; over the capacity raises ``torch.OutOfMemoryError``.

    ``calls`` lists the micro-batch sizes measured, in order, so tests assert the exact sizes tried.
    The out-of-memory error is raised before ``fn`` runs, as a real one would be at the first
    allocation that does not fit.
    """

    name = "fake"
    catches_oom = True

    def __init__(
        self,
        memory: Callable[[int], float],
        capacity_bytes: int,
        *,
        seconds: Callable[[int], float] | None = None,
        reserved: Callable[[int], float] | None = None,
        baseline_bytes: int = 0,
        rounding_bytes: int = 0,
    ) -> None:
        self.memory = memory
        self.reserved = reserved
        self.seconds = seconds
        self._capacity = int(capacity_bytes)
        self.baseline_bytes = baseline_bytes
        self.rounding_bytes = rounding_bytes
        self.calls: list[int] = []

    def measure(self, fn: Callable[[], Any], *, micro_batch_size: int | None = None) -> Measurement:
        if micro_batch_size is None:
            raise TypeError("FakeMeter.measure needs micro_batch_size= (its memory is a formula of it)")
        self.calls.append(micro_batch_size)
        peak = int(self.memory(micro_batch_size))
        reserved = None if self.reserved is None else int(self.reserved(micro_batch_size))
        if max(peak, reserved or 0) > self._capacity:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (fake): micro-batch {micro_batch_size} needs {peak} bytes, "
                f"capacity {self._capacity}"
            )
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        seconds = self.seconds(micro_batch_size) if self.seconds is not None else elapsed
        return Measurement(peak, reserved, float(seconds), self.baseline_bytes, self.rounding_bytes)

    def time(self, fn: Callable[[], Any], *, micro_batch_size: int | None = None) -> float:
        elapsed = super().time(fn)
        if self.seconds is not None and micro_batch_size is not None:
            return float(self.seconds(micro_batch_size))
        return elapsed

    def capacity_bytes(self) -> int:
        return self._capacity

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "device": "fake"}
