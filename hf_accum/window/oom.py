"""The one place that decides whether an exception is an out-of-memory error, and frees memory after one.

Callers run a step through :func:`guarded`, the one out-of-memory guard: it asks :func:`is_oom` and re-raises
everything else (a shape error or a NaN check must never be mistaken for "this micro-batch does not fit"), and after
an out-of-memory error frees memory outside the except block, where the traceback no longer pins the failed step's
activations.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

# Message fragments of allocation failures that do not arrive as ``torch.OutOfMemoryError`` (older
# builds, other back-ends, or an OOM re-wrapped as a plain RuntimeError by a library).  The list follows
# accelerate's ``should_reduce_batch_size`` plus the cuBLAS/cuDNN workspace failures seen on CUDA.
# accelerate also retries on ``CUDNN_STATUS_NOT_SUPPORTED``; that is a kernel limit, not memory, so it is
# deliberately not here: it would be reported as "does not fit" and hide the real error.
_OOM_MESSAGES = (
    "CUDA out of memory",
    " out of memory.",  # CUDA / HIP / XPU caching allocators
    "MPS backend out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS could not allocate its workspace
    "CUDNN_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator (ENOMEM from posix_memalign)
    "PT_DEVMEM Allocation failed",  # Habana HPU
)


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception it was raised from) is an allocation failure.

    ``torch.OutOfMemoryError`` is matched by type; other exceptions by message, because some paths
    (cuBLAS, the CPU allocator, wrapped errors) raise a plain ``RuntimeError``.  A chained cause is
    followed so that an OOM re-raised by a hook or a library wrapper is still recognised.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, torch.OutOfMemoryError):
            return True
        if isinstance(current, MemoryError):  # Python-level allocation failure (e.g. numpy on CPU)
            return True
        if isinstance(current, RuntimeError):
            message = str(current)
            if any(fragment in message for fragment in _OOM_MESSAGES):
                return True
        current = current.__cause__ or current.__context__
    return False


def free_memory() -> None:
    """Release what a failed step left behind so the next trial starts from the same floor.

    ``gc.collect`` drops the reference cycles an exception's traceback keeps alive (frames hold the
    activations); ``empty_cache`` returns the caching allocator's now-free segments to the driver, so
    the next trial's reserved-memory reading is not inflated by the failed one.
    """
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def guarded(step: Callable[[], T], *, catch: bool = True,
            never: tuple[type[BaseException], ...] = ()) -> tuple[T | None, bool]:
    """Run ``step()``: ``(its result, False)``, or ``(None, True)`` after an out-of-memory error, memory freed
    (`free_memory`, once the except block has ended and its traceback, holding the failed step's frames and their
    activations, is gone). Any other exception propagates, as does an out-of-memory error when ``catch`` is False
    and an exception of a type in ``never`` (a control-flow signal raised while an OOM was being handled carries that
    OOM as its context)."""
    try:
        return step(), False
    except never:
        raise
    except Exception as exc:
        if not (catch and is_oom(exc)):
            raise
    free_memory()
    return None, True
