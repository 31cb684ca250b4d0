"""What a loss kernel is, and the registry that holds them (as `levers/base.py` holds the levers).

A loss kernel computes the causal LM's training loss from the hidden states entering the LM head and the head's
weight, without the caller building the (rows, vocab) logits: ``loss_sum(hidden, weight, bias, targets)`` is the
float32 (float64 for float64 inputs) sum over rows of ``cross_entropy(hidden @ weight.T + bias, targets)``, with a
gradient for ``hidden``, ``weight`` and ``bias``. `token_loss` is the one seam every caller goes through: it drops
the rows labelled -100 (prompt and padding cost nothing), runs the kernel and returns ``(token-loss sum, count)``,
so a window's loss is normalized by the window's own count (loss.py) whatever the kernel, the cuts or a re-run.

A kernel module states:

* ``NAME`` (the pin in ``levers="loss_kernel=NAME"``, the plan's record), ``PACKAGE`` (the pip name of the library
  it calls, None for torch's own) and ``SETTINGS`` (the loss settings it computes, e.g. ``("label_smoothing",)``);
* ``unavailable(device_type, dtype, autocast) -> str | None``: why it cannot run there (no package, no CUDA, a dtype
  whose loss it would round), None when it can;
* ``loss_sum(hidden, weight, bias, targets, *, label_smoothing=0.0)``: the sum above, on rows that all count;
* ``memory(rows, hidden, vocab, itemsize, device_type, weight_grad=True) -> Memory``: the bytes it allocates
  beyond its inputs and its gradients' outputs, for the estimate and the planner (`Memory`);
* ``COUNTED_BY_OPS``: True when its allocations are ordinary operators that fake tensors count one by one (the
  estimate then runs it); False when they happen inside one operator or a Triton launch (the estimate then runs
  its memory model, `paper.py`).

Adding one: its file, its tests (tests/levers/test_kernels.py runs every registered kernel that runs here against the
float64 reference), one `register` line in `kernels/__init__.py`, and the docs.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Memory:
    """A kernel's memory beyond its inputs, in bytes: ``held`` from its forward to its backward (what it saves, e.g.
    gradients computed in the forward), ``forward`` and ``backward`` the most it holds at once inside each call and
    frees before returning (chunk logits, their float32 copy and gradient). ``grads_in_forward``: the gradients of
    the hidden states and the weight are among ``held`` (computed in the forward, returned by the backward in place);
    otherwise the backward allocates them as it returns."""

    held: int
    forward: int
    backward: int
    grads_in_forward: bool = False  # ``held`` includes the input gradients, made in the forward and handed on

    @property
    def peak(self) -> int:
        """The most the loss holds at once: what it keeps plus the larger of its two transients."""
        return self.held + max(self.forward, self.backward)


_REGISTRY: dict[str, ModuleType] = {}


def register(kernel: ModuleType) -> ModuleType:
    """Add ``kernel`` (a module as the docstring describes) to the registry; its name must be new."""
    if kernel.NAME in _REGISTRY and _REGISTRY[kernel.NAME] is not kernel:
        raise ValueError(f"a loss kernel named {kernel.NAME!r} is already registered")
    _REGISTRY[kernel.NAME] = kernel
    return kernel


def registered() -> list[ModuleType]:
    """The registered kernels, in registration order (the last one runs everywhere: the fallback)."""
    return list(_REGISTRY.values())


def get(name: str) -> ModuleType:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"loss_kernel={name!r} is not a loss kernel; the registered ones are "
                         f"{', '.join(_REGISTRY)}") from None


def package_missing(package: str, module: str) -> str | None:
    """The refusal for a library that is not installed (one line naming the pip command), None when it is."""
    if importlib.util.find_spec(module) is None:
        return f"{package} is not installed (pip install {package})"
    return None


def triton_package_missing(package: str, module: str, device_type: str) -> str | None:
    """The refusal for a CUDA-only (Triton) kernel library: not installed, or not on CUDA (None: it runs)."""
    if device_type != "cuda" and not package_missing(package, module):
        return f"its Triton kernels run on CUDA only (not {device_type})"
    return package_missing(package, module)


def unavailable(name: str, device_type: str, dtype: torch.dtype, autocast: bool = False) -> str | None:
    """Why kernel ``name`` cannot run on ``device_type`` with ``dtype`` weights (None: it can)."""
    return get(name).unavailable(device_type, dtype, autocast)


def runnable(device_type: str, dtype: torch.dtype, autocast: bool = False) -> list[str]:
    """The kernels that run on ``device_type`` with ``dtype`` weights, in registration order."""
    return [k.NAME for k in registered() if k.unavailable(device_type, dtype, autocast) is None]


def default(device_type: str, dtype: torch.dtype, autocast: bool = False) -> str:
    """The kernel used before (or without) a measurement: the first registered kernel that runs there -- a
    well-kept library's before ours, which runs everywhere and is registered last."""
    return runnable(device_type, dtype, autocast)[0]


def refuse_settings(name: str, label_smoothing: float = 0.0) -> None:
    """ValueError naming the kernel and the setting when ``name`` cannot compute the loss asked for."""
    if label_smoothing and "label_smoothing" not in get(name).SETTINGS:
        raise ValueError(f"loss kernel {name!r} does not compute label smoothing (label_smoothing_factor="
                         f"{label_smoothing}); pin one that does (levers=\"loss_kernel=chunked\") or set "
                         "fused_loss=False")


def token_loss(name: str, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               targets: torch.Tensor, *, label_smoothing: float = 0.0,
               counted: bool = False, paper: bool = False) -> tuple[torch.Tensor, torch.Tensor | int]:
    """``(sum of the token losses, number of counted tokens)`` over ``hidden`` (rows, hidden_size) and ``targets``
    (rows,), rows labelled -100 not counted, through kernel ``name``. ``counted=True``: the caller already dropped
    them (fused_loss.py does, before the head sees a row). ``paper=True`` (the estimate, on fake tensors): a kernel
    whose allocations fake tensors do not see runs as its memory model (`paper.loss_sum`)."""
    refuse_settings(name, label_smoothing)
    if counted:
        count = targets.shape[0]
    else:
        keep = targets != IGNORE_INDEX
        count = keep.sum()
        hidden, targets = hidden[keep], targets[keep]
    if hidden.shape[0] == 0:
        # Zero, but connected to the head and the hidden states: DDP expects a gradient for every used parameter.
        return F.linear(hidden, weight, bias).float().sum(), count
    if paper and not get(name).COUNTED_BY_OPS:
        from . import paper as on_paper

        return on_paper.loss_sum(get(name), hidden, weight, bias), count
    return get(name).loss_sum(hidden, weight, bias, targets, label_smoothing=label_smoothing), count


def choose(measured: dict[str, tuple[float, int]], budget_bytes: int, default_name: str) -> str:
    """The kernel the plan takes: of ``measured`` (name -> (seconds per step, peak bytes) at the planned micro-batch),
    the fastest whose peak fits ``budget_bytes``; ties go to the earlier-registered (a library's). ``default_name``
    (the kernel the search ran with) when none fits."""
    fits = {name: seconds for name, (seconds, peak) in measured.items() if peak <= budget_bytes}
    if not fits:
        return default_name
    order = [k.NAME for k in registered()]
    return min(fits, key=lambda name: (fits[name], order.index(name) if name in order else len(order)))
