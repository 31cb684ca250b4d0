"""A meter for steps run on fake tensors: no storage is allocated, so it counts the bytes each would take.

:class:`StorageCounter` is a dispatch mode pushed above ``FakeTensorMode`` for the whole estimate: every storage an
operator creates is recorded with its size and a weak reference whose callback subtracts it again when Python frees
it, so the running total follows what a real allocator would hold, through autograd's saved tensors, the freed
activations of backward and the optimizer's temporaries.  :class:`PaperMeter` reads that total the way
:class:`~hf_accum.probing.meters.CpuMeter` reads the profiler: the peak reached during the step relative to its start, plus
what the model and the optimizer hold (``baseline``).  Reading a value (``.item()``) is answered with 1: a fake
tensor has none, and the values read in a training step (AdamW's step count) do not change what it allocates.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .meters import Measurement, Meter


def _rounded(nbytes: int, granule: int) -> int:
    return -(-nbytes // granule) * granule if granule > 1 else nbytes


_MASKED = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
           torch.ops.aten._index_put_impl_.default)


def _worst_case_masks(args: tuple) -> tuple:
    """``args`` of an indexing op with each boolean mask replaced by the integer indices of an all-true mask (a
    fake mask has no values; the probe's batches label every position but one, so all-true is the step's size)."""
    indices = args[1]
    if not any(i is not None and i.dtype is torch.bool for i in indices):
        return args
    out = []
    for i in indices:
        if i is not None and i.dtype is torch.bool:
            out += [torch.zeros(i.numel(), dtype=torch.long, device=i.device)] * i.dim()
        else:
            out.append(i)
    return (args[0], out, *args[2:])


class StorageCounter(TorchDispatchMode):
    """Counts the bytes of every live storage created by an operator while it is active.

    ``granule``: each storage is charged rounded up to this many bytes (CUDA's caching allocator hands out
    multiples of 512 bytes; the CPU allocator the bytes requested)."""

    def __init__(self, granule: int = 1, allocator: Any = None) -> None:
        super().__init__()
        self.granule = granule
        self.allocator = allocator  # `reserved.CachingAllocator` on CUDA: every storage's life replayed through it
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return True if args[0].dtype is torch.bool else 1
        if func in _MASKED:  # a boolean mask's shape depends on its values: every element counted as set
            args = _worst_case_masks(args)
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):  # most operators: one tensor, no tree to walk
            self.track(out)
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    def track(self, t: torch.Tensor) -> None:
        """Charge ``t``'s storage once, until Python frees it (a view or an in-place result shares it)."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        n = _rounded(storage.nbytes(), self.granule)
        self.live[key] = (weakref.ref(storage, lambda _ref, key=key: self._freed(key)), n)
        if self.allocator is not None:
            self.allocator.malloc(key, storage.nbytes())
        self.current += n
        self.peak = max(self.peak, self.current)

    def _freed(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]
            if self.allocator is not None:
                self.allocator.free(key)

    def held_bytes(self, tensors: list[torch.Tensor]) -> int:
        """Bytes of the distinct storages of ``tensors``, each charged as the counter charges it."""
        seen: dict[int, int] = {}
        for t in tensors:
            storage = t.untyped_storage()
            seen[storage._cdata] = _rounded(storage.nbytes(), self.granule)
        return sum(seen.values())


def resident_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """What is live before a step: weights, buffers, gradients, optimizer state (the probe's CPU baseline)."""
    out = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    out += list(model.buffers())
    if optimizer is not None:
        out += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


class PaperMeter(Meter):
    """The peak bytes of a step on fake tensors; ``capacity_bytes``: the card being planned for.

    The optimizer the probe creates is found by a global step hook (the probe builds it itself): its state, created
    in the warm-up step, is part of every later trial's baseline, as on a real device."""

    name = "estimate"
    catches_oom = True
    times_steps = False

    def __init__(self, counter: StorageCounter, model: torch.nn.Module, capacity_bytes: int, device: str,
                 also_held: list[torch.Tensor] | None = None) -> None:
        self.counter = counter
        self.also_held = list(also_held or [])  # held outside the model and optimizer (DPO's frozen reference)
        self.model = model
        self._capacity = int(capacity_bytes)
        self.device = device
        self.optimizer: torch.optim.Optimizer | None = None
        self.peaks: dict[int, int] = {}  # micro-batch -> the last peak measured at it
        self._hook = register_optimizer_step_pre_hook(self._seen)

    def _seen(self, optimizer: torch.optim.Optimizer, *_args: Any) -> None:
        self.optimizer = optimizer

    def close(self) -> None:
        self._hook.remove()

    def measure(self, fn: Callable[[], Any], *, micro_batch_size: int | None = None) -> Measurement:
        held = resident_tensors(self.model, self.optimizer) + self.also_held
        for t in held:  # known before the step, so an in-place result on it is not a new allocation
            self.counter.track(t)
        baseline = self.counter.held_bytes(held)
        start = self.counter.current
        self.counter.peak = start
        allocator = self.counter.allocator
        if allocator is not None:  # as the CUDA meter: the previous step's cached segments dropped first
            allocator.empty_cache()
            allocator.reset_peak()
        fn()
        peak = baseline + self.counter.peak - start
        if micro_batch_size is not None:
            self.peaks[micro_batch_size] = peak
        reserved = None if allocator is None else allocator.peak_reserved
        # no seconds: a step on fake tensors takes no device time, so the level search has no time lines and
        # its chooser ranks by memory alone (fewest forwards, then fewest checkpointed layers)
        return Measurement(peak_bytes=peak, reserved_bytes=reserved, seconds=None, baseline_bytes=baseline)

    def time(self, fn: Callable[[], Any], *, micro_batch_size: int | None = None) -> float:
        """Says 0.0: no device time to measure. Runs ``fn()`` only as the warm-up, where the optimizer has no state
        yet (the step creates it, and the gradients every later step keeps); once it has, a step leaves what is live
        as it found it (a size measures the same after any other: tests/probing/test_paper_session.py), so the
        timings a search asks for later (the level search's plain steps) would step for nothing and are not run."""
        if self.optimizer is None or not self.optimizer.state:
            fn()
        return 0.0

    def capacity_bytes(self) -> int:
        return self._capacity

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "device": f"{self.device} (estimated on fake tensors)"}
