"""What `AccumulationMixin` does in evaluation: each batch goes to `evaluation.EvalLoss` (an exact eval_loss in
training's unit, an OOM re-run of the failed batch alone), and `evaluate` first has the planner measure the eval batch
once (`auto_eval_batch_size`, planning/eval_batch.py). Reads `_adapter`, `_planner`, `_eval_loss`, `_eval_cap` and
`_collective()` of `AccumulationMixin`.
"""

from __future__ import annotations

from ..compat import trl_internals
from ..window import evaluation


class EvaluationHooks:
    """The evaluation overrides (`AccumulationMixin`'s second base: it comes before the Trainer)."""

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        if not self._adapter.exact_eval:
            return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                           metric_key_prefix)
        self._eval_loss = evaluation.eval_loss_for(self)
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
        finally:
            tally, self._eval_loss = self._eval_loss, None
        self._eval_cap = tally.cap
        tally.finish(output.metrics, metric_key_prefix, self._collective())
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        step = super().prediction_step
        if self._eval_loss is None:  # called outside evaluation_loop
            return step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        return self._eval_loss.step(lambda batch, loss_only: step(model, batch, loss_only, ignore_keys=ignore_keys),
                                    inputs, prediction_loss_only)

    def evaluate(self, eval_dataset=None, *args, **kwargs):
        # Measured on the trainer's own eval set (a TRL trainer prepares a dataset passed here only in its evaluate).
        if self._adapter.exact_eval and self._planner.wants_eval_batch(self.collectives_in_compute_loss) and self.eval_dataset is not None and (eval_dataset is None
                                                                            or isinstance(eval_dataset, str)):
            self._plan_eval_batch(eval_dataset)
        return super().evaluate(eval_dataset, *args, **kwargs)

    @trl_internals.trl_metrics_kept  # the measuring steps are not evaluation: TRL's eval metrics must not average them
    def _plan_eval_batch(self, dataset) -> None:
        """`auto_eval_batch_size`: measured with the Trainer's own prediction_step (`Planner.plan_eval_batch`)."""
        self._planner.plan_eval_batch(dataset, lambda model, batch, loss_only: super(
            EvaluationHooks, self).prediction_step(model, batch, loss_only))
