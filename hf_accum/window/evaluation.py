"""Evaluation as a window: an exact ``eval_loss``, and out-of-memory errors that re-run only the batch that failed.

transformers' `evaluation_loop` gives every sample its batch's mean loss and averages those, so on batches of
different label counts its ``eval_loss`` changes with `per_device_eval_batch_size`, with the number of ranks and
with any re-run at a smaller batch. Here every evaluation forward's loss path is driven as training drives it: it
is handed its batch's own count as `num_items_in_batch`, so it returns the mean over that count (see loss.py), and
each rank keeps the sum of mean x count and the sum of counts. After the loop the ranks add theirs and

    eval_loss = (sum of losses over every counted unit of the evaluation set) / (number of those units),

the unit training uses ("tokens": every counted label, after the causal shift; "samples": every sample). Rows that
accelerate repeats to complete the last batch of every rank (and that `gather_for_metrics` drops) are forwarded
apart and not counted.

Where that cannot be known (a loss computed without labels, a `prediction_step` that does not pass through
`compute_loss`, a loss that is not one number) the evaluation keeps transformers' value, said once per reason; the
two are never mixed.

An out-of-memory error in an evaluation forward re-runs that batch alone, in halves (again for a half that fails);
the halves' outputs are put back together, so the Trainer gathers what a clean run gathers, and since sums and
counts add, ``eval_loss`` is unchanged. Later batches are cut beforehand to the size that fitted. Where forwards
run collectives over several ranks (FSDP, DeepSpeed, TRL's metric gathering) no rank may run more of them than the
others, so the OOM is raised as is.

TRL trainers log ``eval_num_tokens``, which is TRL's count of *training* tokens seen so far (kept as TRL defines
it); the evaluation's own tokens (the attention mask's, each row once, accelerate's repeats left out) are added as
``eval_tokens``.

A non-finite batch loss makes ``eval_loss`` non-finite (transformers' `logging_nan_inf_filter` drops such samples:
an exact mean has nothing to drop them from).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from ..compat import trainer_internals, trl_internals
from .loss import LabelSpec
from .oom import guarded
from .units import Cutter, detect_unit, make_cutter

logger = logging.getLogger(__name__)

Run = Callable[[dict, bool], tuple]  # (batch, prediction_loss_only) -> (loss, logits, labels): prediction_step


def eval_loss_for(trainer) -> EvalLoss:
    """The `EvalLoss` of one evaluation of ``trainer`` (an `AccumulationMixin`): its labels, its unit, and whether an
    OOM may be re-run on one rank; the cap and the reasons said carry over between its evaluations."""
    try:
        labels = trainer._label_spec() if trainer._normalization != "model" else LabelSpec()
    except ValueError as exc:  # a model whose loss hf_accum cannot count: transformers' value, said once
        labels = str(exc)
    # An OOM re-run forwards more on one rank: not where forwards run collectives (FSDP, ZeRO, TRL's metrics).
    can_split = trainer.engine.evaluates_alone(trainer.collectives_in_compute_loss)
    return EvalLoss(trainer, trainer._normalization, trainer.batch_unit, labels, can_split=can_split,
                    cap=trainer._eval_cap, said=trainer._eval_said)


class EvalLoss:
    """One evaluation on one rank: drives each forward's loss (`step`) and keeps its sum and count; `finish` adds
    the ranks' and writes ``eval_loss``. ``mode`` "model" keeps transformers' value and only re-runs OOMs.

    ``can_split``: whether a batch may be re-run as more forwards on this rank alone after an OOM (not where
    forwards run collectives over several ranks: FSDP, DeepSpeed, TRL's metric gathering; the OOM is then raised).
    ``cap``: the most units per forward known to fit (from an earlier OOM); ``said``: the reasons already logged,
    shared across a trainer's evaluations."""

    def __init__(self, trainer, mode: str, unit: str | None, labels: LabelSpec | str, *, can_split: bool,
                 cap: int | None = None, said: set | None = None):
        self.trainer, self.mode, self.unit, self.can_split, self.cap = trainer, mode, unit, can_split, cap
        self.said = said if said is not None else set()
        self.labels = labels if isinstance(labels, LabelSpec) else None
        self.unknown: str | None = None if self.labels is not None or mode == "model" else str(labels)
        self.total: torch.Tensor | float = 0.0
        self.count: torch.Tensor | int = 0
        self.device = trainer.args.device
        self.tokens: int | None = 0 if trl_internals.trl_counts_tokens(trainer) else None  # eval_tokens

    # --- one batch ----------------------------------------------------------------------------------------------
    def step(self, run: Run, batch: Mapping, loss_only: bool) -> tuple:
        """prediction_step's result for ``batch``, recording its exact loss share."""
        cutter = self._cutter(batch)
        kept, cut = trainer_internals.eval_rows_kept(self.trainer, _rows(batch))
        if cut is None:
            pieces = [(batch, kept > 0)]
        elif cutter is not None and cutter.unit == "rows":  # one of the ranks keeps part: every rank cuts there
            head, tail = cutter.cut_at(batch, cut)
            pieces = [(head, cut <= kept), (tail, kept > cut)]
        else:
            self._cannot("the last evaluation batch holds rows accelerate repeats to even out the ranks, and batches "
                         f"of {cutter.unit if cutter else 'this kind'} cannot be cut at them")
            pieces = [(batch, False)]
        parts = [self._forward(run, piece, loss_only, record, cutter) for piece, record in pieces]
        return _join(parts, cutter.unit if cutter else "rows")[0]

    def _forward(self, run: Run, batch: Mapping, loss_only: bool, record: bool, cutter: Cutter | None):
        """(prediction_step's result, the weight of its loss: its count when known, else its units)."""
        units = cutter.units(batch) if cutter is not None else 1
        splittable = cutter is not None and self.can_split and cutter.unit in _JOINABLE
        if splittable and self.cap is not None and units > self.cap:
            chunks = cutter.cut(batch, self.cap, trim=False)
            return _join([self._forward(run, c, loss_only, record, cutter) for c in chunks], cutter.unit)
        count = self._count(batch, cutter)
        def forward():
            with trainer_internals.prediction_loss_counted(self.trainer, _for_loss(count, self.device)) as seen:
                return run(batch, loss_only), seen

        done, oom = guarded(forward, catch=splittable and units > 1)
        if oom:
            self.cap = min(self.cap or units, (units + 1) // 2)
            logger.warning("hf_accum: out of memory in evaluation on a batch of %d; re-running that batch in halves "
                           "(the metrics are those of a clean run); later batches: at most %d per forward",
                           units, self.cap)
            halves = cutter.cut_even(batch, 2, trim=False)
            return _join([self._forward(run, h, loss_only, record, cutter) for h in halves], cutter.unit)
        out, seen = done
        if record:
            self._record(out[0], seen, count)
            if self.tokens is not None:
                self.tokens += _tokens(batch)
        return out, (count if count is not None else units)

    def _cutter(self, batch: Mapping) -> Cutter | None:
        try:
            return make_cutter(self.unit or detect_unit(batch), self.labels or LabelSpec())
        except ValueError:
            return None

    def _count(self, batch: Mapping, cutter: Cutter | None) -> torch.Tensor | None:
        """The batch's count in the training unit, on the device; None where it has none."""
        if self.mode == "model" or self.labels is None:
            return None
        if cutter is None:
            return self._cannot("its batches cannot be cut into units")
        if self.mode == "tokens" and self.labels.key not in batch and "shift_labels" not in batch:
            return None  # no labels to count: a loss is then computed without them (`_record` says so)
        try:
            return cutter.count(batch, self.mode).to(self.device)
        except ValueError as exc:
            return self._cannot(str(exc))

    def _record(self, loss, seen: list, count: torch.Tensor | None) -> None:
        if loss is None or self.mode == "model" or self.unknown is not None:
            return
        if count is None:
            self._cannot(f"a batch gave a loss without {self.labels.key!r} labels to count (e.g. return_loss)")
        elif len(seen) != 1 or seen[0] is None:
            self._cannot("prediction_step did not compute its loss through compute_loss(..., num_items_in_batch=)")
        elif seen[0].numel() != 1:
            self._cannot(f"compute_loss returned a loss of shape {tuple(seen[0].shape)}, not one number per batch")
        else:
            dtype = torch.float32 if self.device.type == "mps" else torch.float64  # MPS has no float64
            self.total = self.total + seen[0].detach().to(self.device, dtype) * count.to(dtype)
            self.count = self.count + count

    def _cannot(self, reason: str) -> None:
        if self.unknown is None:
            self.unknown = reason
        return None

    # --- the evaluation's result --------------------------------------------------------------------------------
    def finish(self, metrics: dict, prefix: str, collective) -> None:
        """Replace ``{prefix}_loss`` by the exact mean over every rank's counted units (every rank calls this)."""
        if self.tokens is not None:
            dtype = torch.float32 if self.device.type == "mps" else torch.float64
            tokens = collective.sum(torch.tensor([float(self.tokens)], dtype=dtype, device=self.device))
            metrics[f"{prefix}_tokens"] = int(tokens.item())
        if self.mode == "model":
            return
        dtype = torch.float32 if self.device.type == "mps" else torch.float64
        local = torch.stack([torch.as_tensor(v, dtype=dtype, device=self.device).reshape(())
                             for v in (self.total, self.count, float(self.unknown is not None))])
        total, count, unknown = (float(x) for x in collective.sum(local).tolist())
        key = f"{prefix}_loss"
        if key not in metrics:
            return
        if unknown or count == 0:
            reason = self.unknown or ("another rank could not count its loss" if unknown else
                                      f"no {self.mode[:-1]} of the evaluation set is counted")
            if reason not in self.said:
                self.said.add(reason)
                logger.warning("hf_accum: %s is transformers' value (each sample weighted by its batch's mean loss, "
                               "so it depends on the eval batch size): %s.", key, reason)
            return
        metrics[key] = total / count


# --- putting a batch's pieces back together -------------------------------------------------------------------
_JOINABLE = ("rows", "sequences")  # padded rows join along dim 0, one packed row along its tokens (dim 1)


def _join(parts: list, unit: str):
    """One prediction_step result (and weight) from the results of consecutive pieces of a batch."""
    if len(parts) == 1:
        return parts[0]
    outs, weights = [p[0] for p in parts], [p[1] for p in parts]
    losses = [o[0] for o in outs]
    loss = None
    total = sum(weights)
    if all(x is not None for x in losses):
        denom = total.clamp(min=1) if torch.is_tensor(total) else max(total, 1)
        dtype = torch.float32 if losses[0].device.type == "mps" else torch.float64
        loss = (sum(x.detach().to(dtype) * w for x, w in zip(losses, weights)) / denom).to(losses[0].dtype)
    dim = 1 if unit == "sequences" else 0
    logits = _concat([o[1] for o in outs], dim)
    labels = _concat([o[2] for o in outs], dim)
    return (loss, logits, labels), total


def _concat(values: list, dim: int):
    first = values[0]
    if first is None:
        return None
    if isinstance(first, list | tuple):
        return type(first)(_concat([v[i] for v in values], dim) for i in range(len(first)))
    if isinstance(first, Mapping):
        return type(first)({k: _concat([v[k] for v in values], dim) for k in first})
    if torch.is_tensor(first) and first.dim() > dim:
        return torch.cat(values, dim)
    return first  # a per-batch value (not cut with the rows)


def _rows(batch: Mapping) -> int:
    return next((int(v.shape[0]) for v in batch.values() if torch.is_tensor(v) and v.dim() > 0), 0)


def _tokens(batch: Mapping) -> int:
    """A batch's tokens as TRL counts them: its attention mask, else (padding-free) its packed row's length."""
    if torch.is_tensor(batch.get("attention_mask")):
        return int(batch["attention_mask"].sum())
    if torch.is_tensor(batch.get("position_ids")):
        return int(batch["position_ids"].shape[-1])
    ids = batch.get("input_ids")
    return int(ids.numel()) if torch.is_tensor(ids) else 0


def _for_loss(count: torch.Tensor | None, device) -> torch.Tensor | None:
    # Clamped as training does, so an all-masked batch gives 0 (times a count of 0) instead of 0/0.
    return None if count is None else count.clamp(min=1).to(device)
