"""Run real training steps at chosen micro-batch sizes through a meter; save -> try -> restore in finally.

The pieces, from the inside out:

* :func:`probe_micro_batches` drives :class:`~hf_accum.planning.search.MicroBatchSearch` with any ``step_fn(micro)``
  and any :class:`~hf_accum.meters.Meter`: one warm-up step (not a trial: it creates the optimizer's
  state), then the trials the search proposes.  An out-of-memory error means "does not fit".
* :func:`preserved` is the save/restore context: weights, gradients, RNG streams and training flags are
  put back exactly, whatever happens inside.
* :func:`make_step_fn` builds the ``step_fn`` of a model, an optimizer and a batch factory.
* :func:`probe_model` ties them together for the trainer and the CLI and returns the plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .levers import CheckpointChooser, Choice, Level, fit_time_line, scale_line
from .meters import CpuMeter, CudaMeter, Meter, live_tensor_bytes
from .oom import free_memory, is_oom
from .planning.plan import (
    Plan,
    choose_fastest,
    forward_breakpoints,
    nearest_exact_targets,
    plan_batch,
    plan_for_micro,
)
from .planning.search import MicroBatchSearch

StepFn = Callable[[int], Any]
MakeBatch = Callable[[int], dict[str, Any]]  # micro_batch_size -> collated batch at the worst-case length
Log = Callable[[str], None]

DEFAULT_BUDGET_FRACTION = 0.9


@dataclass
class Trial:
    """One micro-batch size the probe tried.  ``status``: "fits", "over budget", "out of memory", or
    "refused" (on CPU: predicted over the memory this process can get, never run)."""

    micro_batch_size: int
    peak_bytes: int | None
    reserved_bytes: int | None
    seconds: float | None
    fits: bool
    status: str
    predicted_bytes: float | None = None
    baseline_bytes: int | None = None  # held before the step (weights, gradients, optimizer state): its base
    checkpointed_layers: int | None = None  # the checkpointing level it ran at, when the probe tried levels

    @property
    def samples_per_second(self) -> float | None:
        return self.micro_batch_size / self.seconds if self.seconds else None


@dataclass
class ProbeResult:
    """What the probe measured and concluded.

    ``max_micro_batch_size``: the largest size measured to fit (0: none).  ``fitted``: the memory line
    ``(a, b)`` (bytes ≈ a + b·micro) from the points nearest the budget, None with fewer than two.
    ``next_size``/``next_verdict``: the smallest plan-usable size above the maximum and how it is known
    not to fit: "measured" (it ran, or was refused, and did not fit), "predicted" (by the line) or
    "cap" (no size is left under the cap).  ``chosen_micro_batch_size``: the throughput mode's pick.
    """

    trials: list[Trial]
    max_micro_batch_size: int
    fitted: tuple[float, float] | None
    budget_bytes: int
    capacity_bytes: int
    max_micro_batch: int
    next_size: int | None = None
    next_verdict: str = "cap"
    warmup_seconds: float | None = None
    device: str = ""
    optimize: str = "memory"
    chosen_micro_batch_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def measured_trials(self) -> list[Trial]:
        """Trials that actually ran (a refused size did not)."""
        return [t for t in self.trials if t.status != "refused"]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fitted"] = (
            None if self.fitted is None else {"a_bytes": self.fitted[0], "b_bytes_per_sample": self.fitted[1]}
        )
        return out


class NothingFitsError(ValueError):
    """Even micro-batch 1 exceeds the budget; ``result`` holds what was measured."""

    def __init__(self, message: str, result: ProbeResult) -> None:
        super().__init__(message)
        self.result = result


# --- the probe loop ---------------------------------------------------------------------------------------
def probe_micro_batches(
    step_fn: StepFn,
    meter: Meter,
    budget_bytes: int,
    max_micro_batch: int,
    *,
    must_resolve: Sequence[int] = (),
    optimize: str = "memory",
    warmup: bool = True,
    limit_bytes: int | None = None,
    log: Log | None = None,
) -> ProbeResult:
    """Find the largest micro-batch whose step fits ``budget_bytes``, measuring real steps.

    ``step_fn(micro)`` runs one complete training step (forward, backward, optimizer step) at that
    micro-batch size and keeps no reference to its tensors.  ``must_resolve``: the sizes a plan can use
    (`plan.forward_breakpoints` of the per-rank target: each the smallest reaching its forward count); the search does not stop while one of them between the largest
    fit and the estimate is unresolved.  ``limit_bytes``: for meters that cannot catch an OOM (CPU), the
    most a step may be predicted to need before it is refused unrun (default: the meter's capacity
    minus what others hold).  ``optimize="throughput"`` also times every fitting size in
    ``must_resolve`` and sets ``chosen_micro_batch_size`` to the one with the least time per optimizer step.
    """
    if optimize not in ("memory", "throughput"):
        raise ValueError(f'optimize must be "memory" or "throughput", got {optimize!r}')
    say = log or (lambda _msg: None)
    capacity = meter.capacity_bytes()
    if limit_bytes is None and not meter.catches_oom:
        limit_bytes = capacity - meter.unavailable_bytes()
    search = MicroBatchSearch(budget_bytes, max_micro_batch, must_resolve=must_resolve)
    trials: list[Trial] = []
    result = ProbeResult(trials, 0, None, int(budget_bytes), capacity, max_micro_batch, optimize=optimize)
    result.device = str(meter.describe().get("device", meter.name))

    if warmup:
        # The optimizer allocates its state (Adam: two tensors per parameter) in its first step; a trial
        # without it would under-measure every later step by that much.
        say("warm-up step at micro-batch 1 (creates the optimizer state; not a trial)")
        try:
            result.warmup_seconds = meter.time(lambda: step_fn(1), micro_batch_size=1)
        except Exception as exc:
            if not is_oom(exc):
                raise
            result.warmup_seconds = None
        if result.warmup_seconds is None:  # outside the except block: its traceback no longer pins memory
            free_memory()
            trials.append(Trial(1, None, None, None, False, "out of memory"))
            return result

    while (micro := search.propose()) is not None:
        trials.append(_run_trial(step_fn, meter, search, micro, limit_bytes, say))
    _finish(result, search)

    if optimize == "throughput" and result.max_micro_batch_size > 0:
        _time_fitting_divisors(step_fn, meter, search, result, must_resolve, say)
    return result


def _run_trial(
    step_fn: StepFn, meter: Meter, search: MicroBatchSearch, micro: int, limit_bytes: int | None, say: Log
) -> Trial:
    predicted = search.predict(micro)
    if limit_bytes is not None and predicted is not None and predicted + search.margin_bytes() > limit_bytes:
        # CPU: the kernel's OOM killer would end the process instead of raising; never find out by trying.
        search.record(micro, None, fits=False)
        say(f"micro-batch {micro}: refused, predicted {_gib(predicted)} > limit {_gib(limit_bytes)}")
        return Trial(micro, None, None, None, False, "refused", predicted)
    m = None
    try:
        m = meter.measure(lambda: step_fn(micro), micro_batch_size=micro)
    except Exception as exc:
        if not is_oom(exc):
            raise
    if m is None:
        # Freed here, after the except block: until it ends, the exception's traceback keeps the failed
        # step's frames, and with them its activations, alive.
        free_memory()
        search.record(micro, None)
        say(f"micro-batch {micro}: out of memory")
        return Trial(micro, None, None, None, False, "out of memory", predicted)
    obs = search.record(micro, m.charged_bytes, baseline_bytes=m.baseline_bytes, rounding_bytes=m.rounding_bytes)
    status = "fits" if obs.fits else "over budget"
    say(f"micro-batch {micro}: peak {_gib(m.peak_bytes)}, {m.seconds:.3f} s, {status}")
    return Trial(micro, m.peak_bytes, m.reserved_bytes, m.seconds, obs.fits, status, predicted, m.baseline_bytes)


def _finish(result: ProbeResult, search: MicroBatchSearch) -> None:
    result.max_micro_batch_size = search.largest_fit
    result.fitted = search.line()
    result.next_size, result.next_verdict = search.next_over()


def _time_fitting_divisors(
    step_fn: StepFn,
    meter: Meter,
    search: MicroBatchSearch,
    result: ProbeResult,
    must_resolve: Sequence[int],
    say: Log,
) -> None:
    """Throughput mode: time every fitting size a plan can use and pick the one with the least time per optimizer
    step (`plan.choose_fastest`).

    A size not yet measured is measured first (memory grows with the micro-batch, so it should fit;
    the meter checks).  Times then come from two unmeasured runs, keeping the faster: a measured run
    pays for the profiler (CPU) or for refilling an emptied allocator cache (CUDA), and the first run at
    a new size pays for allocator growth, neither of which a steady training step has.
    """
    fitting = [d for d in must_resolve if d <= result.max_micro_batch_size]
    if not fitting:
        return
    measured = {t.micro_batch_size for t in result.trials if t.fits}
    rates: dict[int, float] = {}
    for d in fitting:
        if d not in measured:
            trial = _run_trial(step_fn, meter, search, d, None, say)
            result.trials.append(trial)
            if not trial.fits:
                continue
        seconds = min(meter.time(lambda d=d: step_fn(d), micro_batch_size=d) for _ in range(2))
        rates[d] = d / seconds
        say(f"micro-batch {d}: {rates[d]:.1f} samples/s")
    result.extra["samples_per_second"] = dict(rates)
    rates = agree_on_rates(rates)
    if rates:
        result.chosen_micro_batch_size = choose_fastest(rates, max(must_resolve), result.max_micro_batch_size)
    _finish(result, search)


# --- data parallel ----------------------------------------------------------------------------------------
def _dist_device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def agree_max_micro_batch(local_max: int) -> int:
    """The smallest of every rank's largest fitting micro-batch (all-reduce MIN), so all ranks adopt one
    plan; ``local_max`` unchanged when torch.distributed is not initialized."""
    if not _distributed():
        return local_max
    import torch.distributed as dist

    t = torch.tensor([int(local_max)], dtype=torch.int64, device=_dist_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def agree_on_rates(rates: dict[int, float]) -> dict[int, float]:
    """Throughput across ranks: a data-parallel step lasts as long as its slowest rank, so each size's
    rate becomes the MIN over ranks; sizes some rank did not time are dropped."""
    if not _distributed():
        return rates
    import torch.distributed as dist

    sizes = list(range(1, max(rates, default=0) + 1))
    world_max = torch.tensor([len(sizes)], dtype=torch.int64, device=_dist_device())
    dist.all_reduce(world_max, op=dist.ReduceOp.MAX)
    n = int(world_max.item())
    t = torch.tensor([rates.get(i + 1, -1.0) for i in range(n)], dtype=torch.float64, device=_dist_device())
    present = (t > 0).to(torch.int64)
    dist.all_reduce(present, op=dist.ReduceOp.MIN)
    t = torch.where(present.bool(), t, torch.full_like(t, math.inf))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return {i + 1: float(t[i]) for i in range(n) if present[i]}


# --- save -> try -> restore --------------------------------------------------------------------------------
@dataclass
class _Saved:
    params: list[tuple[torch.Tensor, torch.Tensor]]
    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    grads: list[tuple[torch.nn.Parameter, torch.Tensor | None]]


def _save_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def _restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


@contextlib.contextmanager
def modes_and_rng_preserved(model: torch.nn.Module) -> Iterator[None]:
    """Run the block, then put every module's ``training`` flag and the torch, CUDA, numpy and ``random`` RNG
    states back, even on error (the engine probe restores the weights through DeepSpeed instead)."""
    modes, rng = [(m, m.training) for m in model.modules()], _save_rng()
    try:
        yield
    finally:
        for module, flag in modes:
            module.training = flag
        _restore_rng(rng)


@contextlib.contextmanager
def preserved(model: torch.nn.Module) -> Iterator[None]:
    """Run the block, then put the model and the RNG back exactly as they were, even on error.

    Saved: trainable parameters and all buffers (copies in CPU memory, so a GPU probe does not measure
    its own snapshot), gradients (the same tensor objects are reattached, their values copied back),
    every module's ``training`` flag, and the torch, CUDA, numpy and ``random`` RNG states.  Frozen
    parameters (a LoRA base, quantized weights) are not copied: no optimizer holds them, so a step
    cannot change them, and copying a frozen multi-GB base would cost more than the probe.
    """
    saved = _Saved(
        params=[(p, p.detach().to("cpu", copy=True)) for p in model.parameters() if p.requires_grad],
        buffers=[(b, b.detach().to("cpu", copy=True)) for b in model.buffers()],
        grads=[(p, None if p.grad is None else p.grad.detach().to("cpu", copy=True)) for p in model.parameters()],
    )
    grad_objects = {id(p): p.grad for p in model.parameters()}
    with modes_and_rng_preserved(model):
        try:
            yield
        finally:
            with torch.no_grad():
                for live, copy in saved.params + saved.buffers:
                    live.copy_(copy)
                for p, g in saved.grads:
                    if g is None:
                        p.grad = None
                    else:
                        original = grad_objects[id(p)]
                        original.copy_(g)
                        p.grad = original
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                # the probe's cached segments go back before training allocates; on CPU there is no cache to return
                # and a full collection of a process that imported transformers costs ~0.3 s for nothing
                free_memory()


def fresh_optimizer_like(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A new optimizer of the same class over the same parameter groups and hyperparameters, without
    state: the probe steps it and discards it, so the real one is never touched."""
    inner = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer wraps the real one
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])} for g in optimizer.param_groups
    ]
    try:
        return type(optimizer)(groups, **optimizer.defaults)
    except TypeError:  # a class whose defaults hold keys its __init__ does not take; the groups carry them
        return type(optimizer)(groups)


# --- the step -----------------------------------------------------------------------------------------------
def _default_forward(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    return model(**batch).loss


def make_step_fn(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    make_batch: MakeBatch,
    *,
    forward: Callable[[torch.nn.Module, dict[str, Any]], torch.Tensor] | None = None,
    autocast_dtype: torch.dtype | None = None,
    max_grad_norm: float | None = None,
) -> StepFn:
    """``step_fn(micro)``: one real training step at that micro-batch size.

    ``make_batch(micro)`` returns the collated batch, on the model's device, every sequence at the
    worst-case length.  ``forward(model, batch)`` returns the loss (default: ``model(**batch).loss``);
    a trainer passes its ``compute_loss``.  The gradients are zeroed, not freed, after the step: during
    an accumulation window every micro-step but the first starts with all gradients allocated, which is
    the peak to plan for.
    """
    fwd = forward or _default_forward
    device_type = next(model.parameters()).device.type

    def step_fn(micro: int) -> None:
        model.train()
        batch = make_batch(micro)
        ctx = (
            torch.autocast(device_type=device_type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with ctx:
            loss = fwd(model, batch)
        loss.backward()
        del loss, batch
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    return step_fn


def random_token_batch(model: torch.nn.Module, seq_len: int) -> MakeBatch:
    """``make_batch`` for a causal LM: random ids, every position a label but one. With two rows or more, the last
    row's last position is padding: batches of mixed lengths carry a padding mask, which can cost more memory than
    its tokens (SDPA then builds masked scores), and a single pad token leaves every per-token cost as it was."""
    vocab = int(model.config.vocab_size)
    device = next(model.parameters()).device

    def make_batch(micro: int) -> dict[str, Any]:
        ids = torch.randint(0, vocab, (micro, seq_len), device=device)
        mask = torch.ones_like(ids)
        labels = ids.clone()
        if micro > 1 and seq_len > 1:
            mask[-1, -1] = 0
            labels[-1, -1] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return make_batch


# --- the entry point for the trainer and the CLI -------------------------------------------------------------
def resolve_budget(
    meter: Meter,
    budget_bytes: int | None,
    budget_fraction: float | None,
    *,
    names: tuple[str, str] = ("budget_bytes", "budget_fraction"),
) -> int:
    """The budget in bytes from exactly one of bytes / fraction. A fraction is of the memory this process can
    use now (capacity minus what other processes hold), so the default keeps a margin on a shared device
    instead of refusing to start. ``names``: how the caller's user spells the two (messages name them)."""
    bytes_name, fraction_name = names
    capacity = meter.capacity_bytes()
    usable = capacity - meter.unavailable_bytes()
    held = f"{_gib(capacity)} capacity minus {_gib(capacity - usable)} held by other processes or outside torch"
    if budget_bytes is not None and budget_fraction is not None:
        raise ValueError(f"give either {bytes_name} or {fraction_name}, not both")
    if budget_bytes is None:
        fraction = DEFAULT_BUDGET_FRACTION if budget_fraction is None else budget_fraction
        if not 0 < fraction <= 1:
            raise ValueError(f"{fraction_name}={fraction} must be in (0, 1]: a fraction of the memory this process "
                             f"can use on {meter.name} ({_gib(usable)} now)")
        budget_bytes = int(fraction * usable)
        if budget_bytes <= 0:
            raise ValueError(f"{fraction_name}={fraction} leaves no memory on {meter.name}: {held}. Free memory "
                             "held by other processes.")
        return budget_bytes
    if budget_bytes <= 0:
        raise ValueError(f"{bytes_name}={budget_bytes} must be positive (the device has {_gib(capacity)})")
    if budget_bytes > usable:
        raise ValueError(
            f"{bytes_name}={budget_bytes} ({_gib(budget_bytes)}) exceeds what this process can use on {meter.name} "
            f"now: {held}. Set {fraction_name} instead (a fraction of the memory usable when the probe starts, "
            f"e.g. 0.9), or free memory held by other processes."
        )
    return int(budget_bytes)


def probe_model(
    model: torch.nn.Module,
    *,
    seq_len: int,
    target_batch_size: int,
    world_size: int = 1,
    budget_bytes: int | None = None,
    budget_fraction: float | None = None,
    budget_names: tuple[str, str] = ("budget_bytes", "budget_fraction"),
    make_batch: MakeBatch | None = None,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    optimizer_kwargs: dict[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    forward: Callable[[torch.nn.Module, dict[str, Any]], torch.Tensor] | None = None,
    autocast_dtype: torch.dtype | None = None,
    max_grad_norm: float | None = None,
    meter: Meter | None = None,
    max_micro_batch: int | None = None,
    optimize: str = "memory",
    log: Log | None = None,
    lever: Any = None,
) -> tuple[ProbeResult, Plan]:
    """Probe ``model`` and plan ``target_batch_size``: returns what was measured and the exact plan.

    ``lever`` (`checkpointing.Lever`: ``num_layers`` and ``at(k)``, a context setting k checkpointed layers): also
    choose how many layers recompute (:func:`probe_levels`); the plan then records k, and the caller applies it.

    The probe steps a fresh optimizer (``optimizer_cls(trainable params, **optimizer_kwargs)``, or one
    like ``optimizer`` if given, whose own state is never touched) and leaves the model, its gradients
    and the RNG as they were.  Every rank of a data-parallel run calls this; all adopt the smallest
    rank's maximum, so the plans agree.  Raises ``ValueError`` before any step for bad input and
    :class:`NothingFitsError` when micro-batch 1 exceeds the budget.
    """
    # Cheap checks first: no step runs on input that cannot give a plan.
    if target_batch_size < 1 or world_size < 1:
        raise ValueError(f"target_batch_size={target_batch_size} and world_size={world_size} must be >= 1")
    if target_batch_size % world_size:
        options = " or ".join(map(str, nearest_exact_targets(target_batch_size, world_size)))
        raise ValueError(
            f"target_batch_size={target_batch_size} is not divisible by world_size={world_size}; "
            f"set target_batch_size to {options}"
        )
    max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if max_positions is not None and seq_len > max_positions:
        raise ValueError(
            f"probe seq_len={seq_len} exceeds the model's max_position_embeddings={max_positions}; "
            f"set probe_seq_len <= {max_positions}"
        )
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    per_rank = target_batch_size // world_size
    cap = per_rank if max_micro_batch is None else min(per_rank, max_micro_batch)
    if cap < 1:
        raise ValueError(f"max_micro_batch={max_micro_batch} must be >= 1")

    on_cuda = next(model.parameters()).device.type == "cuda"
    with preserved(model):
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no trainable parameters (requires_grad=False everywhere)")
        opt = (
            fresh_optimizer_like(optimizer)
            if optimizer is not None
            else optimizer_cls(trainable, **(optimizer_kwargs or {}))
        )
        if meter is None:
            meter = CudaMeter(next(model.parameters()).device) if on_cuda else None
        if meter is None or (isinstance(meter, CpuMeter) and meter.resident is None):
            meter = CpuMeter(resident=lambda: live_tensor_bytes(model, opt))
        budget = resolve_budget(meter, budget_bytes, budget_fraction, names=budget_names)
        step_fn = make_step_fn(
            model,
            opt,
            make_batch or random_token_batch(model, seq_len),
            forward=forward,
            autocast_dtype=autocast_dtype,
            max_grad_norm=max_grad_norm,
        )
        try:
            if lever is None:
                result = probe_micro_batches(
                    step_fn, meter, budget, cap, must_resolve=forward_breakpoints(per_rank), optimize=optimize, log=log
                )
            else:
                if optimize == "throughput" and log is not None:  # said, not silently dropped
                    log("auto_tune_optimize='throughput': the checkpointing lever already chooses rows and layers by "
                        "measured step time; no separate timing of every size")
                result = probe_levels(step_fn, meter, budget, cap, per_rank, lever,
                                      must_resolve=forward_breakpoints(per_rank), log=log)
        finally:
            opt.state.clear()  # the probe's optimizer state goes now, not whenever the closures die
    result.extra["seq_len"] = seq_len
    plan = plan_from_result(result, target_batch_size, world_size)
    chosen = result.extra.get("checkpointing")
    if chosen is not None:
        plan = dataclasses.replace(plan, checkpointed_layers=chosen["chosen_k"], num_layers=chosen["num_layers"],
                                   step_seconds=chosen.get("step_seconds"))
    return result, plan


# --- checkpointing levels ---------------------------------------------------------------------------------------
MAX_VERIFY_STEPS = 3  # verifying steps before the chooser falls back to a measured point


def probe_levels(step_fn: StepFn, meter: Meter, budget_bytes: int, cap: int, per_rank: int, lever: Any, *,
                 must_resolve: Sequence[int] = (), log: Log | None = None) -> ProbeResult:
    """Choose the micro-batch and how many of the ``lever.num_layers`` layers recompute, by measurement.

    1. the micro-batch search without checkpointing (k = 0); when the whole per-rank window (or the cap) fits, that
       is the answer: recompute only adds time;
    2. otherwise the same search with every layer checkpointed (k = L), reusing the optimizer state;
    3. the step-time lines: the searches' own timings give each level's shape, and one plain step (no meter
       instrumentation) at the cheapest level's largest fit levels them all (`_levels`);
    4. `levers.CheckpointChooser` proposes the fastest predicted (rows, k); a proposal no measurement covers is
       verified by a real step (at most `MAX_VERIFY_STEPS`, then the best measured point).
    Ranks agree on every measured figure (the most constrained rank's), so all make the same choice. The result's
    ``max_micro_batch_size`` is the chosen rows per forward (0: nothing fits even with every layer checkpointed);
    ``extra["checkpointing"]`` records the levels, the choice and its predicted seconds per optimizer step."""
    say = log or (lambda _msg: None)
    num_layers = lever.num_layers
    results: dict[int, ProbeResult] = {}
    say(f"checkpointing level 0 of {num_layers} layers (none)")
    with lever.at(0):
        results[0] = probe_micro_batches(step_fn, meter, budget_bytes, cap, must_resolve=must_resolve, log=log)
    if agree_max_micro_batch(results[0].max_micro_batch_size) < cap:
        say(f"checkpointing level {num_layers} of {num_layers} layers (all)")
        with lever.at(num_layers):
            results[num_layers] = probe_micro_batches(
                step_fn, meter, budget_bytes, cap, must_resolve=must_resolve, log=log,
                warmup=results[0].warmup_seconds is None)
    trials: list[Trial] = []
    for k, r in results.items():
        for t in r.trials:
            t.checkpointed_layers = k
            trials.append(t)
    measured, timed = _levels(results, step_fn, meter, lever)
    levels = _agree_levels(measured)
    # every input of the chooser equal on all ranks, so all make the same proposals (and verifying steps, each one
    # collective): the tightest rank's budget with the agreed levels
    chooser = CheckpointChooser(per_rank, num_layers, _tightest_budget(budget_bytes), levels, cap=cap)
    limit = None if meter.catches_oom else meter.capacity_bytes() - meter.unavailable_bytes()
    verify = MicroBatchSearch(budget_bytes, cap)
    steps = 0
    choice = chooser.propose()
    while choice is not None and chooser.accepted is None:
        if steps == MAX_VERIFY_STEPS:
            chooser.accepted = chooser.best_verified()
            break
        steps += 1
        with lever.at(choice.k):
            trial = _run_trial(step_fn, meter, verify, choice.micro, limit, say)
        trial.checkpointed_layers = choice.k
        trials.append(trial)
        chooser.record(choice, agree_max_micro_batch(int(trial.fits)) == 1)
        choice = chooser.propose()
    accepted, seconds, checked = _timed_choice(chooser, timed, per_rank, step_fn, meter, lever)
    base = results[accepted.k] if accepted is not None and accepted.k in results else results[max(results)]
    result = dataclasses.replace(base, trials=trials, extra=dict(base.extra))
    result.max_micro_batch_size = accepted.micro if accepted is not None else 0
    result.chosen_micro_batch_size = None
    record: dict[str, Any] = {
        "num_layers": num_layers,
        "levels": [dataclasses.asdict(lv) for lv in levels],
        "verify_steps": steps,
        "chosen_k": accepted.k if accepted is not None else num_layers,
    }
    if checked is not None:
        record["checked_against"] = checked
    if accepted is not None:
        record["step_seconds"] = accepted.forwards * seconds if seconds else accepted.predicted_seconds
        record["chosen"] = dataclasses.asdict(accepted)
        say(f"chosen: {accepted.micro} rows per forward, {accepted.forwards} forwards, checkpointing {accepted.k} of "
            f"{num_layers} layers, ~{record['step_seconds'] or 0.0:.3f} s per optimizer step")
    result.extra["checkpointing"] = record
    return result


def _timed_choice(chooser: CheckpointChooser, timed: tuple[int, int, float] | None, per_rank: int, step_fn: StepFn,
                  meter: Meter, lever: Any) -> tuple[Choice | None, float, dict[str, Any] | None]:
    """The accepted choice, its plain seconds per forward (the slowest rank's; 0.0 when untimed) and what it was
    checked against. A choice other than the plainly timed point is timed plainly too, and the two are compared as
    measured: the timed point (a level's largest fit, measured to fit) wins when its optimizer step is faster, so
    one noisy instrumented step cannot choose recompute that does not pay. Every input is equal on all ranks."""
    accepted = chooser.accepted
    if accepted is None:
        return None, 0.0, None
    at_timed = timed is not None and timed[:2] == (accepted.micro, accepted.k)
    seconds = timed[2] if at_timed else _timed_step(step_fn, meter, lever, accepted.micro, accepted.k)  # not run twice
    seconds = _slowest_rank(seconds or 0.0)
    if timed is None or at_timed:
        return accepted, seconds, None
    micro, k, other = timed
    other = _slowest_rank(other)
    forwards = math.ceil(per_rank / micro)
    checked = {"micro": micro, "k": k, "forwards": forwards, "step_seconds": forwards * other}
    if seconds and other and forwards * other < accepted.forwards * seconds:
        rows = math.ceil(per_rank / forwards)
        accepted = Choice(rows, k, forwards, chooser.predict_bytes(rows, k), forwards * other, True)
        return accepted, other, checked
    return accepted, seconds, checked


def _levels(results: dict[int, ProbeResult], step_fn: StepFn, meter: Meter,
            lever: Any) -> tuple[list[Level], tuple[int, int, float] | None]:
    """What the chooser needs of each measured level: the memory line, and the step-time line through the search's
    timings. Those ran under the meter's instrumentation (on CPU a profiler), so one plain step at the level whose
    largest fit holds the fewest rows gives the ratio of plain to instrumented seconds, and every line is scaled by
    it: one extra step, the cheapest, instead of one per level (the full level's largest fit is often the whole
    window, the probe's dearest step). The level is chosen from agreed figures, so every rank times the same one.
    Returns the levels and the plainly timed step as (micro, k, seconds), None when no level fits."""
    lines = {}
    for k, result in results.items():
        lines[k] = fit_time_line([(t.micro_batch_size, t.seconds) for t in result.trials if t.fits and t.seconds])
    # the largest fit every rank has (ranks with different budgets differ): which step is timed, and at how many rows,
    # must be the same everywhere, since what follows compares it through collectives
    largest = {k: agree_max_micro_batch(r.max_micro_batch_size) for k, r in results.items()}
    timeable = [k for k in results if largest[k] >= 1]
    timed = None
    ratio = None
    if timeable:
        k = min(timeable, key=lambda k: (largest[k], k))
        micro = largest[k]
        seconds = _timed_step(step_fn, meter, lever, micro, k)
        instrumented = lines[k][0] + lines[k][1] * micro if lines[k] is not None else 0.0
        timed = (micro, k, seconds or 0.0)  # the same point on every rank (an OOM here is one rank's: 0.0)
        if seconds and instrumented > 0:
            ratio = seconds / instrumented
    levels = []
    for k, result in results.items():
        time = lines[k]
        if time is not None and ratio is not None:
            time = scale_line(time, ratio)
        failure = min((t.micro_batch_size for t in result.trials if not t.fits), default=None)
        levels.append(Level(k, result.max_micro_batch_size, failure, result.fitted, time))
    return levels, timed


def _timed_step(step_fn: StepFn, meter: Meter, lever: Any, micro: int, k: int) -> float | None:
    try:
        with lever.at(k):
            return meter.time(lambda: step_fn(micro), micro_batch_size=micro)
    except Exception as exc:
        if not is_oom(exc):
            raise
    free_memory()
    return None


def _tightest_budget(budget_bytes: float) -> float:
    """The smallest budget of all ranks (a rank sharing its device has less)."""
    if not _distributed():
        return budget_bytes
    import torch.distributed as dist

    t = torch.tensor([float(budget_bytes)], dtype=torch.float64, device=_dist_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())


def _slowest_rank(seconds: float) -> float:
    """A data-parallel step lasts as long as its slowest rank: the MAX over ranks."""
    if not _distributed():
        return seconds
    import torch.distributed as dist

    t = torch.tensor([float(seconds)], dtype=torch.float64, device=_dist_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _agree_levels(levels: list[Level]) -> list[Level]:
    """Every rank's levels replaced by the most constrained: the smallest fits and failures, the largest lines, a line
    only where every rank has one (so the chooser's inputs, and with them its proposals, are equal on all ranks)."""
    if not _distributed():
        return levels
    import torch.distributed as dist

    big = float(2**62)
    rows = []
    for lv in levels:
        rows.append([-lv.largest_fit, -(lv.smallest_failure or big), -float(lv.memory is not None),
                     -float(lv.time is not None), *(lv.memory or (0.0, 0.0)), *(lv.time or (0.0, 0.0))])
    t = torch.tensor(rows, dtype=torch.float64, device=_dist_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out = []
    for lv, row in zip(levels, t.tolist()):
        failure = None if -row[1] >= big else int(-row[1])
        memory = (row[4], row[5]) if row[2] == -1.0 else None
        time = (row[6], row[7]) if row[3] == -1.0 else None
        out.append(Level(lv.k, int(-row[0]), failure, memory, time))
    return out


def plan_from_result(result: ProbeResult, target_batch_size: int, world_size: int) -> Plan:
    """The exact plan from what the probe measured, every rank adopting the smallest rank's maximum; raises
    :class:`NothingFitsError` when micro-batch 1 did not fit."""
    result.extra.update({"target_batch_size": target_batch_size, "world_size": world_size})
    agreed = agree_max_micro_batch(result.max_micro_batch_size)
    if agreed != result.max_micro_batch_size:
        result.extra["local_max_micro_batch_size"] = result.max_micro_batch_size
        result.max_micro_batch_size = agreed
    if result.max_micro_batch_size < 1:
        raise NothingFitsError(_nothing_fits_message(result), result)
    plan = plan_batch(target_batch_size, world_size, result.max_micro_batch_size)
    if result.optimize == "throughput" and result.chosen_micro_batch_size:
        plan = plan_for_micro(target_batch_size, world_size, min(result.chosen_micro_batch_size, plan.micro_batch_size))
    return plan


def _nothing_fits_message(result: ProbeResult) -> str:
    levels = result.extra.get("checkpointing")
    full = None if levels is None else levels["num_layers"]
    first = next((t for t in result.trials if t.micro_batch_size == 1 and t.checkpointed_layers in (None, full)
                  and t.status != "refused"), None)
    need = None if first is None else (first.reserved_bytes or first.peak_bytes)
    amount = (
        f"needs {_gib(need)}, {_gib(need - result.budget_bytes)} over the budget of {_gib(result.budget_bytes)}"
        if need
        else f"ran out of memory under the budget of {_gib(result.budget_bytes)}"
    )
    if levels is not None:
        return (
            f"even micro-batch 1 with every one of the {full} layers checkpointed does not fit: one training step "
            f"{amount}. What is left: train LoRA adapters instead of all weights, load the base model in 4-bit "
            "(QLoRA), shorten sequences (max_length / probe_seq_len), shard the model over more ranks (FSDP or "
            "DeepSpeed ZeRO), or raise the memory budget."
        )
    return (
        f"even micro-batch 1 does not fit: one training step {amount}. To fit: enable gradient checkpointing, "
        "train LoRA adapters instead of all weights, load the base model in 4-bit (QLoRA), shorten the probe "
        "sequence length, or raise the memory budget."
    )


def _gib(n: float | None) -> str:
    return "?" if n is None else f"{n / 2**30:.3f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"
