"""A plan before anything loads: the probe's own search, planner and report, run on a model built from its config
on fake tensors (no weights read, no memory allocated), measured by :class:`~.paper_meter.PaperMeter`.

The step is the probe's step (`probe.make_step_fn` through `probe.probe_model`), so what the real step frees, keeps
and creates (autograd's saved tensors, the gradients kept zeroed, AdamW's state and temporaries) is counted as it
happens rather than by formula.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from . import paper_pairs
from .loop import MakeBatch, ProbeResult
from .paper_meter import PaperMeter, StorageCounter
from .paper_quantized import quantized_model
from .plan import Plan
from .probe import make_step_fn, probe_model
from .reserved import CachingAllocator, expandable_from_env

DEVICES = ("cpu", "cuda")
TASKS = ("causal_lm", "classification")  # the head and its labels: one per token, or one per sample
CUDA_GRANULE = 512  # the CUDA caching allocator's smallest block: every allocation is a multiple of it

#: What `--device cuda` assumes of the card, said in every report (the estimate runs on CPU kernels).
CUDA_ASSUMPTIONS = (
    "attention: SDPA with a fused kernel (flash / memory-efficient: no seq x seq scores kept), as CPU SDPA",
    "bf16: CPU autocast's op lists stand in for CUDA's (weights keep the dtype the config builds them in)",
    "AdamW: the foreach kernels, torch's default on CUDA (their temporaries span all parameters of a dtype)",
    "CUDA context and cuBLAS workspaces not counted: the budget is a fraction of --device-memory",
)


def cuda_assumptions(expandable: bool) -> tuple[str, ...]:
    """`CUDA_ASSUMPTIONS` and the one line saying how reserved bytes (what the plan fits by) are predicted."""
    from .reserved import describe

    return (*CUDA_ASSUMPTIONS, describe(expandable))


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
    #: checkpointed layers -> {micro-batch -> predicted peak}: every level the estimate ran (``checkpoint_layers``
    #: "auto": the level search's anchors and its choice; a pinned level: that one; None: the model as built)
    level_peaks: dict[int, dict[int, int]] = field(default_factory=dict)
    checkpointed_layers: int | None = None  # the level ``peaks`` and the plan are at (None: as built)
    #: how reserved bytes (what a CUDA probe fits by) were predicted: "allocator model" (`reserved.py`), None on CPU
    reserved: str | None = None

    def to_json(self) -> dict[str, Any]:
        from .report import to_json

        return {**to_json(self.result, self.plan, self.seq_len), "estimated": True, "estimate_device": self.device,
                "peaks": {str(k): v for k, v in sorted(self.peaks.items())}, "assumptions": list(self.assumptions),
                "loss": self.loss, "checkpointed_layers": self.checkpointed_layers, "reserved": self.reserved,
                "level_peaks": {str(k): {str(m): v for m, v in sorted(p.items())}
                                for k, p in sorted(self.level_peaks.items())}}


def batches(model: torch.nn.Module, seq_len: int, pair_step, task: str = "causal_lm") -> MakeBatch:
    """The batches of the step: the task's (a causal LM's or a classification head's), or the pairs'
    (`paper_pairs.py`)."""
    return batch_for(task)(model, seq_len) if pair_step is None else pair_step.make_batch


def forward_of(pair_step):
    return None if pair_step is None else pair_step.forward


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
                    made[id(p)].__dict__.update(p.__dict__)  # what a stand-in notes on its weight (paper_quantized)
                module._parameters[name] = made[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                if id(b) not in made:
                    made[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=device)
                module._buffers[name] = made[id(b)]


@contextlib.contextmanager
def fake_session(granule: int = 1, allocator: CachingAllocator | None = None):
    """Fake tensors and the counter, for building the model and running its steps (one counter sees both);
    ``allocator``: the caching allocator's model the counter replays every storage through (CUDA)."""
    counter = StorageCounter(granule, allocator)
    with FakeTensorMode(), counter:
        yield counter


def device_session(device: str, expandable: bool):
    """`fake_session` counting as ``device`` allocates: on CUDA 512-byte blocks replayed through the caching
    allocator's model (``expandable``: its segment kind), on CPU the bytes requested."""
    cuda = device == "cuda"
    return fake_session(CUDA_GRANULE if cuda else 1, CachingAllocator(expandable) if cuda else None)


def estimate_model(build, *, seq_len: int, target_batch_size: int, device_memory: int, device: str = "cuda",
                   world_size: int = 1, budget_bytes: int | None = None, budget_fraction: float | None = None,
                   bf16: bool = False, max_micro_batch: int | None = None, log=None, also: tuple[int, ...] = (),
                   all_peaks: bool = True, optimizer: dict[str, Any] | None = None, quantization: str | None = None,
                   pairs: str | None = None, precompute_ref_log_probs: bool = False,
                   quantization_options: dict[str, Any] | None = None, checkpoint_layers: str | int | None = None,
                   levels: Any = None, task: str = "causal_lm") -> Estimate:
    """Estimate the plan of ``build()`` (a callable returning the model, run under fake tensors so no weights exist).

    ``device``: "cpu" (like for like with the probe's CPU meter) or "cuda" (see `CUDA_ASSUMPTIONS`).
    ``device_memory``: the card's memory in bytes; the budget is ``budget_bytes`` or a fraction of it (0.9).
    ``also``: further micro-batch sizes to predict (a comparison with sizes a real probe measured).
    ``all_peaks=False``: ``peaks`` holds only the sizes the search ran and ``also`` (no further steps: the seed of a
    real probe, or a comparison at the sizes a real probe measured).
    ``optimizer``: AdamW's keywords where they differ from the device's default (e.g. ``{"foreach": True}``).
    ``quantization``: "nf4" or "int8", the base's linear layers as bitsandbytes stores and runs them
    (`paper_quantized.py`; a LoRA model's adapters become peft's bitsandbytes LoRA layers); NF4 computes in
    bfloat16 with double quantization (the QLoRA recipe's) unless ``quantization_options`` says otherwise
    (``compute_dtype``, ``double_quant``; `paper_quantized.quantize`).
    ``pairs``: "dpo" or "reward", the step of TRL's DPO / reward trainer on preference pairs (`paper_pairs.py`):
    a micro-batch of m pairs is 2m rows of ``seq_len``; ``precompute_ref_log_probs`` as DPOConfig's (the
    reference log-probs read from the batch, no reference forward).
    ``checkpoint_layers``: None (as built), "all", k (the first k) or "auto": the probe's level search on paper,
    by memory alone (the largest micro-batch, then the fewest checkpointed layers); ``level_peaks`` holds each
    level's peaks. ``levels``: instead, a trainer's lever levels (`levers.base.Levels`), run on the paper model.
    ``task``: "causal_lm" (a label per token) or "classification" (``build`` gives a sequence-classification head:
    a label per sample)."""
    budget_bytes = _checked_budget(device, task, device_memory, budget_bytes, budget_fraction, checkpoint_layers)
    autocast = torch.bfloat16 if bf16 else None
    model, pair_step = _meta_models(build, quantization, quantization_options, pairs, seq_len, precompute_ref_log_probs)
    lever = checkpoint_lever(model, checkpoint_layers) if levels is None else dataclasses.replace(levels, model=model)
    loss_line = on_paper(model, device, autocast is not None) if pair_step is None else pair_step.loss_line
    expandable = expandable_from_env()
    with device_session(device, expandable) as counter:
        to_fake(model)
        if pair_step is not None and pair_step.reference is not None:
            to_fake(pair_step.reference)
        meter = PaperMeter(counter, model, device_memory, device, also_held=paper_pairs.reference_tensors(pair_step))
        peaks_of: dict[str, Any] = {}

        def peaks(result: ProbeResult, warmed: torch.optim.Optimizer | None = None) -> None:
            """Each level's peaks; ``warmed``: the probe's optimizer, still warm (`every_peak` starts from it)."""
            chosen = None if lever is None else result.extra["checkpointing"]["chosen_k"]
            level_peaks = _level_peaks(result, lever, chosen)
            if all_peaks or also:
                level_peaks = {k: _at(lever, k, lambda k=k, known=known: every_peak(
                    model, meter, seq_len, _largest(result, k, chosen), autocast,
                    also if k == chosen or lever is None else (), device, known, pair_step, task, warmed,
                    every=all_peaks))
                    for k, known in level_peaks.items()}
            peaks_of.update(chosen=chosen, level_peaks=level_peaks)

        def warm(result: ProbeResult, _step) -> None:
            """The further sizes while the probe's optimizer (the last to step) is warm, where its state is what
            every_peak's own warm-up would create; else they run after the probe, as every_peak warms up itself."""
            trainable = [p for p in model.parameters() if p.requires_grad]
            if meter.optimizer is not None and same_state(meter.optimizer, trainable):
                peaks(result, meter.optimizer)

        try:
            result, plan = probe_model(
                model, seq_len=seq_len, target_batch_size=target_batch_size, world_size=world_size,
                budget_bytes=budget_bytes, make_batch=batches(model, seq_len, pair_step, task), autocast_dtype=autocast,
                max_micro_batch=max_micro_batch, meter=meter, log=log, lever=lever, forward=forward_of(pair_step),
                optimizer_kwargs=adamw_kwargs(device, optimizer), after=warm if all_peaks or also else None)
            if not peaks_of:
                peaks(result)
            chosen, level_peaks = peaks_of["chosen"], peaks_of["level_peaks"]
        finally:
            meter.close()
    level = chosen if lever is not None else checkpointed_now(model)
    return _estimate_of(result, plan, seq_len, device, loss_line, level_peaks, level, lever is not None, expandable)


def _meta_models(build, quantization, quantization_options, pairs, seq_len, precompute_ref_log_probs):
    """The model on the meta device and the pair step (None but for ``pairs``), DPO's frozen reference copy built as
    the model is: each quantized as asked."""

    def built() -> torch.nn.Module:
        return quantized_model(build(), quantization, **(quantization_options or {}))

    with torch.device("meta"):
        model = built()
        return model, paper_pairs.step_for(pairs, model, seq_len, precompute_ref_log_probs=precompute_ref_log_probs,
                                           reference=built)


def _checked_budget(device: str, task: str, device_memory: int, budget_bytes: int | None,
                    budget_fraction: float | None, checkpoint_layers) -> int:
    """`estimate_model`'s arguments checked (one line each), and the budget in bytes."""
    if device not in DEVICES:
        raise ValueError(f"device={device!r}: give one of {', '.join(DEVICES)}")
    if task not in TASKS:
        raise ValueError(f"task={task!r}: give one of {', '.join(TASKS)}")
    if device_memory <= 0:
        raise ValueError(f"device_memory={device_memory} must be positive, e.g. 80GiB")
    checkpoint_setting(checkpoint_layers)
    if budget_bytes is not None:
        return budget_bytes
    return int((0.9 if budget_fraction is None else budget_fraction) * device_memory)


def _estimate_of(result: ProbeResult, plan: Plan, seq_len: int, device: str, loss_line: str,
                 level_peaks: dict, level, leveled: bool, expandable: bool) -> Estimate:
    """What the paper search measured, as an `Estimate`: the chosen level's peaks, no step times."""
    peaks = dict(sorted(level_peaks.get(level if leveled else None, {}).items()))
    for trial in result.trials:  # a step on fake tensors takes no device time: its seconds would mislead
        trial.seconds = None
    result.warmup_seconds = None
    result.extra.update({"estimated": True, "peaks": peaks, "loss": loss_line})
    assumptions = cuda_assumptions(expandable) if device == "cuda" else ()
    if not leveled:
        level_peaks = {level: peaks}
    level_peaks = {k: dict(sorted(p.items())) for k, p in sorted(level_peaks.items())}
    return Estimate(result, plan, seq_len, device, peaks, assumptions, loss_line, level_peaks, level,
                    "allocator model" if device == "cuda" else None)


CHECKPOINT_KWARGS = {"use_reentrant": False}  # what the trainer's "auto" and the CLI set: the LoRA-safe kind


def checkpoint_setting(value: str | int | None) -> None:
    """ValueError naming ``checkpoint_layers`` and its forms unless ``value`` is one."""
    if value is None or value in ("auto", "all") or (isinstance(value, int) and not isinstance(value, bool)
                                                     and value >= 0):
        return
    raise ValueError(f"checkpoint_layers={value!r}: give None (no checkpointing), 'auto' (the level search), 'all' "
                     "or an integer k >= 0 (the first k decoder layers)")


def checkpoint_lever(model: torch.nn.Module, value: str | int | None):
    """The levels the estimate searches ("auto"; None when the model cannot checkpoint), after setting a pinned
    level ("all", k) on ``model`` as the trainer does; None for no search."""
    from ..compat import gradient_checkpointing as gc
    from ..levers.checkpointing import Levels

    if value is None:
        return None
    levels = gc.checkpoint_levels(model)
    if levels == 0 and value in ("auto", 0):
        return None
    if value == "auto":
        return Levels(model, levels, CHECKPOINT_KWARGS)
    gc.set_checkpointed_layers(model, pinned_level(value, levels, model), CHECKPOINT_KWARGS)
    return None


def pinned_level(value: str | int, levels: int, model: torch.nn.Module) -> int:
    """The layers a pinned ``checkpoint_layers`` ("all", k) checkpoints in ``model`` of ``levels`` levels."""
    if levels == 0 and value != 0:
        raise ValueError(f"checkpoint_layers={value!r}, but {type(model).__name__} cannot checkpoint activations: "
                         "give None")
    k = levels if value == "all" else value
    if k > levels:
        raise ValueError(f"checkpoint_layers={value}, but {type(model).__name__} has {levels} checkpointable "
                         f"layers: give 0..{levels}, 'all' or 'auto'")
    return k


def checkpointed_now(model: torch.nn.Module) -> int:
    from ..compat import gradient_checkpointing as gc

    return gc.checkpointed_count(model) if gc.checkpoint_levels(model) else 0


def _level_peaks(result: ProbeResult, lever, chosen: int | None) -> dict[int, dict[int, int]]:
    """The peaks the search measured, per level (without a lever: one level, the model's own)."""
    out: dict[int, dict[int, int]] = {} if lever is None else {chosen: {}}
    for t in result.trials:
        if t.peak_bytes is not None:
            out.setdefault(t.checkpointed_layers if lever is not None else None, {})[t.micro_batch_size] = t.peak_bytes
    return out if out else {None: {}}


def _largest(result: ProbeResult, k: int | None, chosen: int | None) -> int:
    """The largest micro-batch measured to fit at level ``k`` (the plan's at the chosen one)."""
    if k == chosen:
        return result.max_micro_batch_size
    return max((t.micro_batch_size for t in result.trials if t.fits and t.checkpointed_layers == k), default=0)


def _at(lever, k: int | None, fn):
    with contextlib.nullcontext() if lever is None else lever.at(k):
        return fn()


def on_paper(model: torch.nn.Module, device: str, autocast: bool) -> str:
    """Set the model's fused loss (if installed) to run on paper the kernel the device would run before a
    measurement, and say which: a kernel whose allocations fake tensors do not see runs as its memory model."""
    from ..levers import kernels
    from ..levers.kernels.fused_loss import installed_patch

    patch = installed_patch(model)
    if patch is None:
        return "loss: the model's own, from the full logits (the fused loss is off)"
    weight = patch.model.get_output_embeddings().weight
    name = patch.kernel or kernels.default(device, weight.dtype, autocast)
    patch.kernel, patch.paper = name, True
    how = ("its operators, counted one by one" if kernels.get(name).COUNTED_BY_OPS
           else "its memory model (hf_accum/levers/kernels/)")
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
            peaks = every_peak(model, meter, seq_len, 0, torch.bfloat16 if bf16 else None, tuple(sizes), device,
                               task=task)
            return {m: peaks[m] for m in sizes}
        finally:
            meter.close()


def optimizer_kwargs(device: str) -> dict[str, Any]:
    """AdamW as torch picks it for the device: on CUDA the foreach kernels (their temporaries span every parameter of
    a dtype at once), on CPU one parameter at a time. Fake tensors sit on the CPU, so CUDA's choice is made here."""
    return {"foreach": True} if device == "cuda" else {}


def adamw_kwargs(device: str, optimizer: dict[str, Any] | None) -> dict[str, Any]:
    """The device's AdamW with ``optimizer``'s keywords over it; fused AdamW (optim adamw_torch_fused, the
    trainer's default on CUDA) has no foreach kernels, and torch refuses both at once."""
    kwargs = {**optimizer_kwargs(device), **(optimizer or {})}
    if kwargs.get("fused"):
        kwargs.pop("foreach", None)
    return kwargs


MEASURE_EVERY_UP_TO = 16  # above this many sizes, the sizes between measured ones are read off the line between them


def every_peak(model: torch.nn.Module, meter: PaperMeter, seq_len: int, largest: int,
               autocast: torch.dtype | None, also: tuple[int, ...] = (), device: str = "cpu",
               known: dict[int, int] | None = None, pair_step=None, task: str = "causal_lm",
               warmed: torch.optim.Optimizer | None = None, every: bool = True) -> dict[int, int]:
    """The predicted peak at every micro-batch 1 .. largest + 1 (the probe measured only the sizes its search
    proposed). Up to `MEASURE_EVERY_UP_TO` sizes each is run; beyond, 1, 2, the probe's sizes and the last two are
    run and those between are interpolated: a step's memory grows linearly with its rows between the sizes measured
    (the estimates of tests/probing/test_estimate.py differ by the same bytes per row from micro 2 on).
    ``warmed``: the probe's optimizer after its steps (the gradients allocated): where its state is the tensors this
    one's warm-up would create (`same_state`), this one starts from them instead of a warm-up step (the steps
    measured are this optimizer's, on the same live tensors).
    ``every=False``: only the probe's sizes and ``also``, nothing between them."""
    last = max(largest, 0) + 1
    searched = dict(meter.peaks if known is None else known)  # the probe's own trials
    known = {m: v for m, v in searched.items() if m <= last}
    wanted = set(range(1, last + 1)) if last <= MEASURE_EVERY_UP_TO else {1, 2, last - 1, last} | set(known)
    wanted = (wanted if every else set()) | set(also)
    missing = sorted(m for m in wanted if m not in known and m >= 1)
    if missing:
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, **optimizer_kwargs(device))
        step = make_step_fn(model, opt, batches(model, seq_len, pair_step, task), autocast_dtype=autocast,
                            forward=forward_of(pair_step))
        if warmed is not None and same_state(warmed, trainable):
            opt.state.update({p: warmed.state[p] for p in trainable})  # shared: the steps update them in place
            meter.optimizer = opt  # as its first step would say: the state the next measurement starts from
        else:
            step(1)  # creates the optimizer state, as the probe's warm-up does
        for micro in missing:
            known[micro] = meter.measure(lambda m=micro: step(m)).peak_bytes
        opt.state.clear()
    return {**(interpolate(known, last) if every else searched), **{m: known[m] for m in also}}


def same_state(warmed: torch.optim.Optimizer, trainable: list[torch.nn.Parameter]) -> bool:
    """Whether ``warmed`` holds, for every parameter of ``trainable``, what AdamW's first step creates (any of its
    kernels: plain, foreach or fused): the step count (a float32 scalar) and two moments shaped and typed as the
    parameter, and the parameter's gradient."""
    for p in trainable:
        state = warmed.state.get(p, {})
        if set(state) != {"step", "exp_avg", "exp_avg_sq"} or p.grad is None:
            return False
        step, moments = state["step"], (state["exp_avg"], state["exp_avg_sq"])
        if not isinstance(step, torch.Tensor) or step.shape != () or step.dtype != torch.float32:
            return False
        if any(m.shape != p.shape or m.dtype != p.dtype or m.stride() != p.stride() for m in moments):
            return False
    return True


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
