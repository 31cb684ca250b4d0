"""A plan before anything loads: the probe's own search, planner and report, run on a model built from its config
on fake tensors (no weights read, no memory allocated), measured by :class:`~.paper_meter.PaperMeter`.

The step is the probe's step (`probe.make_step_fn` through `probe.probe_model`), so what the real step frees, keeps
and creates (autograd's saved tensors, the gradients kept zeroed, AdamW's state and temporaries) is counted as it
happens rather than by formula.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..planning.plan import Plan
from .loop import MakeBatch, ProbeResult
from .paper_meter import PaperMeter, StorageCounter
from .probe import make_step_fn, probe_model

DEVICES = ("cpu", "cuda")
TASKS = ("causal_lm", "classification")  # the head and its labels: one per token, or one per sample
CUDA_GRANULE = 512  # the CUDA caching allocator's smallest block: every allocation is a multiple of it

#: What `--device cuda` assumes of the card, said in every report (the estimate runs on CPU kernels).
CUDA_ASSUMPTIONS = (
    "attention: SDPA with a fused kernel (flash / memory-efficient: no seq x seq scores kept), as CPU SDPA",
    "bf16: CPU autocast's op lists stand in for CUDA's (weights keep the dtype the config builds them in)",
    "AdamW: the foreach kernels, torch's default on CUDA (their temporaries span all parameters of a dtype)",
    f"allocator: every block rounded up to {CUDA_GRANULE} bytes; cached, fragmented segments not modelled "
    "(reserved memory can be a few percent higher)",
    "CUDA context and cuBLAS workspaces not counted: the budget is a fraction of --device-memory",
)


@dataclass
class Estimate:
    """The estimate: the probe's result and plan, and ``peaks`` (micro-batch -> predicted peak bytes, 1 to one
    past the largest that fits)."""

    result: ProbeResult
    plan: Plan
    seq_len: int
    device: str
    peaks: dict[int, int] = field(default_factory=dict)
    assumptions: tuple[str, ...] = ()
    loss: str = ""  # the loss the estimate assumed: the model's own (full logits) or the fused loss's kernel

    def to_json(self) -> dict[str, Any]:
        from .report import to_json

        return {**to_json(self.result, self.plan, self.seq_len), "estimated": True, "estimate_device": self.device,
                "peaks": {str(k): v for k, v in sorted(self.peaks.items())}, "assumptions": list(self.assumptions),
                "loss": self.loss}


def estimate_batch(model: torch.nn.Module, seq_len: int) -> MakeBatch:
    """The probe's batch (`probe.random_token_batch`) with one change: a single row has no padding, and the real step
    then drops its all-ones mask (transformers' SDPA skip), which it cannot tell on a fake mask, so none is given."""
    vocab = int(model.config.vocab_size)

    def make_batch(micro: int) -> dict[str, Any]:
        ids = torch.randint(0, vocab, (micro, seq_len))
        labels = ids.clone()
        if micro == 1 or seq_len == 1:
            return {"input_ids": ids, "labels": labels}
        mask = torch.ones_like(ids)
        mask[-1, -1] = 0
        labels[-1, -1] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return make_batch


def classification_batch(model: torch.nn.Module, seq_len: int) -> MakeBatch:
    """`estimate_batch` for a sequence-classification head: one label per sample (as the recipes' padding collator
    gives it), the same ids and padding mask."""
    tokens = estimate_batch(model, seq_len)
    classes = int(model.config.num_labels)

    def make_batch(micro: int) -> dict[str, Any]:
        return {**tokens(micro), "labels": torch.randint(0, classes, (micro,))}

    return make_batch


def batch_for(task: str) -> Callable[[torch.nn.Module, int], MakeBatch]:
    return classification_batch if task == "classification" else estimate_batch


def to_fake(model: torch.nn.Module, device: str = "cpu") -> None:
    """Replace every meta parameter and buffer by a fake tensor on ``device`` (run under the fake mode), keeping
    tied weights tied. Direct assignment, not ``module.to_empty``: ``_apply`` swaps tensors, which fake ones refuse."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                if id(b) not in made:
                    made[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=device)
                module._buffers[name] = made[id(b)]


@contextlib.contextmanager
def fake_session(granule: int = 1):
    """Fake tensors and the counter, for building the model and running its steps (one counter sees both)."""
    counter = StorageCounter(granule)
    with FakeTensorMode(), counter:
        yield counter


def estimate_model(
    build,
    *,
    seq_len: int,
    target_batch_size: int,
    device_memory: int,
    device: str = "cuda",
    world_size: int = 1,
    budget_bytes: int | None = None,
    budget_fraction: float | None = None,
    bf16: bool = False,
    max_micro_batch: int | None = None,
    log=None,
    also: tuple[int, ...] = (),
    all_peaks: bool = True,
    optimizer: dict[str, Any] | None = None,
    task: str = "causal_lm",
) -> Estimate:
    """Estimate the plan of ``build()`` (a callable returning the model, run under fake tensors so no weights exist).

    ``device``: "cpu" (like for like with the probe's CPU meter) or "cuda" (see `CUDA_ASSUMPTIONS`).
    ``device_memory``: the card's memory in bytes; the budget is ``budget_bytes`` or a fraction of it (0.9).
    ``also``: further micro-batch sizes to predict (a comparison with sizes a real probe measured).
    ``all_peaks=False``: ``peaks`` holds only the sizes the search ran (no further steps: the seed of a real probe).
    ``optimizer``: AdamW's keywords where they differ from the device's default (e.g. ``{"foreach": True}``).
    ``task``: "causal_lm" (a label per token) or "classification" (``build`` gives a sequence-classification head:
    a label per sample)."""
    if device not in DEVICES:
        raise ValueError(f"device={device!r}: give one of {', '.join(DEVICES)}")
    if task not in TASKS:
        raise ValueError(f"task={task!r}: give one of {', '.join(TASKS)}")
    if device_memory <= 0:
        raise ValueError(f"device_memory={device_memory} must be positive, e.g. 80GiB")
    if budget_bytes is None:
        budget_bytes = int((0.9 if budget_fraction is None else budget_fraction) * device_memory)
    autocast = torch.bfloat16 if bf16 else None
    with torch.device("meta"):
        model = build()
    loss_line = on_paper(model, device, autocast is not None)
    with fake_session(CUDA_GRANULE if device == "cuda" else 1) as counter:
        to_fake(model)
        meter = PaperMeter(counter, model, device_memory, device)
        try:
            result, plan = probe_model(
                model, seq_len=seq_len, target_batch_size=target_batch_size, world_size=world_size,
                budget_bytes=budget_bytes, make_batch=batch_for(task)(model, seq_len), autocast_dtype=autocast,
                max_micro_batch=max_micro_batch, meter=meter, log=log,
                optimizer_kwargs={**optimizer_kwargs(device), **(optimizer or {})})
            peaks = (every_peak(model, meter, seq_len, result.max_micro_batch_size, autocast, also, device, task)
                     if all_peaks else dict(sorted(meter.peaks.items())))
        finally:
            meter.close()
    for trial in result.trials:  # a step on fake tensors takes no device time: its seconds would mislead
        trial.seconds = None
    result.warmup_seconds = None
    result.extra.update({"estimated": True, "peaks": peaks})
    assumptions = CUDA_ASSUMPTIONS if device == "cuda" else ()
    result.extra["loss"] = loss_line
    return Estimate(result, plan, seq_len, device, peaks, assumptions, loss_line)


def on_paper(model: torch.nn.Module, device: str, autocast: bool) -> str:
    """Set the model's fused loss (if installed) to run on paper the kernel the device would run before a
    measurement, and say which: a kernel whose allocations fake tensors do not see runs as its memory model."""
    from .. import kernels
    from ..fused_loss import installed_patch

    patch = installed_patch(model)
    if patch is None:
        return "loss: the model's own, from the full logits (the fused loss is off)"
    weight = patch.model.get_output_embeddings().weight
    name = patch.kernel or kernels.default(device, weight.dtype, autocast)
    patch.kernel, patch.paper = name, True
    how = ("its operators, counted one by one" if kernels.get(name).COUNTED_BY_OPS
           else "its memory model (hf_accum/kernels/)")
    return (f"loss: the fused loss, kernel {name} (the default for {str(weight.dtype).removeprefix('torch.')} on "
            f"{device}; the probe times every kernel that runs and may take another), by {how}")


def estimate_peaks(build, sizes: tuple[int, ...], *, seq_len: int, device: str = "cuda",
                   bf16: bool = False, task: str = "causal_lm") -> dict[int, int]:
    """Only the predicted peaks at ``sizes`` (no search, no plan): one warm-up step, then one step per size, as
    a benchmark measures the real ones."""
    with torch.device("meta"):
        model = build()
    on_paper(model, device, bf16)
    with fake_session(CUDA_GRANULE if device == "cuda" else 1) as counter:
        to_fake(model)
        meter = PaperMeter(counter, model, 1, device)
        try:
            peaks = every_peak(model, meter, seq_len, 0, torch.bfloat16 if bf16 else None, tuple(sizes), device, task)
            return {m: peaks[m] for m in sizes}
        finally:
            meter.close()


def optimizer_kwargs(device: str) -> dict[str, Any]:
    """AdamW as torch picks it for the device: on CUDA the foreach kernels (their temporaries span every parameter of
    a dtype at once), on CPU one parameter at a time. Fake tensors sit on the CPU, so CUDA's choice is made here."""
    return {"foreach": True} if device == "cuda" else {}


MEASURE_EVERY_UP_TO = 16  # above this many sizes, the sizes between measured ones are read off the line between them


def every_peak(model: torch.nn.Module, meter: PaperMeter, seq_len: int, largest: int,
               autocast: torch.dtype | None, also: tuple[int, ...] = (), device: str = "cpu",
               task: str = "causal_lm") -> dict[int, int]:
    """The predicted peak at every micro-batch 1 .. largest + 1 (the probe measured only the sizes its search
    proposed). Up to `MEASURE_EVERY_UP_TO` sizes each is run; beyond, 1, 2, the probe's sizes and the last two are
    run and those between are interpolated: a step's memory grows linearly with its rows between the sizes measured
    (the estimates of tests/test_estimate.py differ by the same bytes per row from micro 2 on)."""
    last = max(largest, 0) + 1
    known = {m: v for m, v in meter.peaks.items() if m <= last}  # the probe's own trials: the same step and size
    wanted = set(range(1, last + 1)) if last <= MEASURE_EVERY_UP_TO else {1, 2, last - 1, last} | set(known)
    wanted |= set(also)
    missing = sorted(m for m in wanted if m not in known and m >= 1)
    if missing:
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, **optimizer_kwargs(device))
        step = make_step_fn(model, opt, batch_for(task)(model, seq_len), autocast_dtype=autocast)
        step(1)  # creates the optimizer state, as the probe's warm-up does
        for micro in missing:
            known[micro] = meter.measure(lambda m=micro: step(m)).peak_bytes
        opt.state.clear()
    return {**interpolate(known, last), **{m: known[m] for m in also}}


def interpolate(points: dict[int, int], last: int) -> dict[int, int]:
    """Every size 1..last: measured where known, else on the line between the nearest measured sizes around it."""
    xs = sorted(points)
    out = {}
    for m in range(1, last + 1):
        if m in points:
            out[m] = points[m]
            continue
        lo = max(x for x in xs if x < m)
        hi = min(x for x in xs if x > m)
        out[m] = round(points[lo] + (points[hi] - points[lo]) * (m - lo) / (hi - lo))
    return out
