"""`check_accumulation`: does accumulation give the right gradient on *this* model and *these* data?

It takes the first batch of the training dataloader (exactly the planned micro-batch, so it never runs more
samples in one pass than training will), computes the gradient of one pass over it, then the gradient of the
same samples cut into k smaller chunks by the window engine -- the cut training uses after an OOM, by the
batch's unit (rows, padding-free sequences, preference pairs), trimmed only where that is exact -- through the
trainer's real `training_step`, under the autocast training runs under. Dropout is off for both, so the only
differences are accumulation arithmetic and floating point. Where the engine cannot cut the batch (one unit, an
indivisible batch) the check says so instead of guessing. Gradients, buffers, RNG states and the train/eval
flag are restored; weights are never stepped.

Tolerance: in float64 the two agree to ~1e-8 (not 1e-15: Llama-style models run RMSNorm and rotary
embeddings in float32 even in a float64 model). In float32 reduction order and padding lengths differ between
the passes, ~1e-6; bf16/fp16 weights or autocast round every matmul to 8-11 mantissa bits, so errors of
1e-3..1e-2 are expected and only an error of order 1 (e.g. a loss K times too large) means a real bug.
"""

from __future__ import annotations

import contextlib
import logging
import random
from dataclasses import dataclass

import torch
from torch import nn

from ...compat import trainer_internals
from ...config.settings import Settings
from ...integrations.trl import router_aux
from ...window.engine import WindowEngine, using
from ...window.protocol import Local, Policy, WindowProtocol
from ...window.units import UNIT_NAME, IndivisibleBatch

logger = logging.getLogger(__name__)

DEFAULT_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


@dataclass
class AccumulationCheck:
    relative_error: float | None
    tolerance: float
    micro_batch_sizes: list[int]
    one_pass_size: int
    passed: bool
    skipped_reason: str | None = None
    cause: str | None = None  # a mismatch: what the check assumed that the loss does not satisfy

    def __str__(self) -> str:
        if self.skipped_reason:
            return f"accumulation check skipped: {self.skipped_reason}"
        verdict = "OK" if self.passed else "MISMATCH"
        because = f". Why: {self.cause}" if self.cause and not self.passed else ""
        return (
            f"accumulation check {verdict}: {len(self.micro_batch_sizes)} micro-batches {self.micro_batch_sizes} vs "
            f"one pass of {self.one_pass_size}: relative gradient error {self.relative_error:.3e} "
            f"(tolerance {self.tolerance:.0e}){because}"
        )


def run_accumulation_check(trainer, num_micro_batches: int | None = None, tolerance: float | None = None):
    model = trainer.model
    params = [p for p in model.parameters() if p.requires_grad]
    tolerance = tolerance if tolerance is not None else _default_tolerance(model, trainer.args)
    # Everything, including drawing the first batch (the sampler consumes RNG), happens inside the restore.
    with _restored(trainer, model, params):
        batch = trainer_internals.prepare_inputs(trainer, next(iter(trainer.get_train_dataloader())))
        trained = trainer._window_engine(batch)
        if trained.token_budget is not None:  # the loaded batch is a whole window: check one forward's worth
            batch = trained.cutter.cut_by_tokens(batch, trained.token_budget)[0]
        elif trained.cut_units:
            batch = trained.cutter.cut_near_equal(batch, trained.cut_units)[0]
        # A local engine (no collective, no DDP wrapper) that cuts exactly as training does.
        engine = WindowEngine(trained.cutter, trained.mode, WindowProtocol(Local(), Policy.RERUN),
                              device=trainer.args.device)
        size = engine.cutter.units(batch)
        reason = None
        if size < 2:
            reason = (f"the micro-batch holds 1 {UNIT_NAME[engine.cutter.unit]}, so it cannot be cut without running more "
                      "in one pass than planned")
        else:
            k = min(num_micro_batches or min(size, 4), size)
            try:
                chunks = engine.cutter.cut_even(batch, k, engine.mode)
            except IndivisibleBatch as exc:
                reason = f"the batch cannot be cut exactly: {exc}"
        if reason is not None:
            result = AccumulationCheck(None, tolerance, [size], size, True, reason)
            logger.warning(str(result))
            return result
        with _dropout_off(model), trainer.accelerator.autocast(), using(trainer, engine), router_aux.off(trainer):
            one_pass = _window_gradient(trainer, engine, model, params, [batch])
            accumulated = _window_gradient(trainer, engine, model, params, chunks)

    num = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(accumulated, one_pass)) ** 0.5
    den = sum(float(b.double().pow(2).sum()) for b in one_pass) ** 0.5
    rel = num / den if den > 0 else float(num > 0)
    result = AccumulationCheck(rel, tolerance, [engine.cutter.units(c) for c in chunks], size, rel <= tolerance,
                               cause=_mismatch_cause(trainer, engine.cutter.unit, engine.mode))
    (logger.info if result.passed else logger.warning)(str(result))
    return result


def _mismatch_cause(trainer, unit: str, mode: str) -> str:
    """What a mismatch means, from what the check assumed: the batch was cut into whole ``unit``s and each chunk
    weighted by its count under ``mode``, so the loss is not a mean of per-unit terms over those counts."""
    if mode not in ("tokens", "samples"):
        return (f"loss_normalization={mode!r} leaves the loss as transformers scales it: a compute_loss returning its "
                "micro-batch's mean (most tutorials' override) is then k times too large. Set "
                "loss_normalization='tokens' (or 'samples'), which makes it exact")
    counted = {"tokens": "counted labels", "samples": UNIT_NAME[unit] + "s"}[mode]
    cause = (f"the batch was cut into whole {UNIT_NAME[unit]}s and each forward weighted by its {counted} "
             f"(loss_normalization={mode!r}), so the loss is not a mean of per-{UNIT_NAME[unit]} terms over them")
    if unit == "rows":
        cause += ("; if one loss term spans several rows (a preference pair's chosen and rejected rows, a group of "
                  "completions, in-batch negatives), declare the trainer's batch_unit or use hf_accum.trl's trainers")
    if trainer_internals.computes_own_loss(trainer):
        cause += (f"; {type(trainer).__name__} computes its own loss: it must return the mean over its batch's "
                  f"{counted} (hf_accum passes that count as num_items_in_batch)")
    return cause


def _window_gradient(trainer, engine, model, params, batches) -> list[torch.Tensor]:
    for p in params:
        p.grad = None
    # The same per-window path as the training loop: get_batch_samples counts (through the engine swapped in),
    # training_step scales.
    batches, num_items = trainer.get_batch_samples(iter(batches), len(batches), trainer.args.device)
    with trainer_internals.window_length_set(trainer, len(batches)):
        for b in batches:
            trainer.training_step(model, b, num_items)
    engine.end()
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]


def _default_tolerance(model: nn.Module, args) -> float:
    if Settings(args).bf16 or Settings(args).fp16:
        return DEFAULT_TOLERANCE[torch.bfloat16]
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return max((DEFAULT_TOLERANCE.get(d, 5e-2) for d in dtypes), default=1e-4)


@contextlib.contextmanager
def _dropout_off(model: nn.Module):
    # nn.Dropout modules carry `p`; attention kernels read a float attribute (e.g. Llama's `attention_dropout`).
    saved = []
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            saved.append((module, "p", module.p))
            module.p = 0.0
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float) and not isinstance(value, bool):
                saved.append((module, name, value))
                setattr(module, name, 0.0)
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


@contextlib.contextmanager
def _restored(trainer, model: nn.Module, params):
    grads = [p.grad for p in params]  # the tensors themselves: we only rebind .grad, never write into them
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    was_training = model.training
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    py_rng = random.getstate()
    np_rng = _numpy_rng()
    try:
        yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        model.train(was_training)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
        if np_rng is not None:
            import numpy as np

            np.random.set_state(np_rng)


def _numpy_rng():
    try:
        import numpy as np
    except ImportError:
        return None
    return np.random.get_state()


# --- check_accumulation=True: the result said, and its figure kept with the run --------------------------------------
LOG_KEY = "accumulation_check_relative_error"


def report_before_training(result: AccumulationCheck) -> dict[str, float]:
    """What `train()` does with the check `check_accumulation=True` ran: one line, whatever the verdict (a pass was
    logged at INFO, unseen), and the figure for the first entry the run logs (:data:`LOG_KEY`; the trainer's `log`
    merges it there with the plan's figures: `log_history` entries are indexed by users and integrations, so it
    gets no entry of its own)."""
    if result.passed and result.skipped_reason is None:
        logger.warning("hf_accum: %s", result)  # a mismatch or a skip was already said at WARNING
    return {} if result.relative_error is None else {LOG_KEY: result.relative_error}
