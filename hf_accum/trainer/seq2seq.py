"""transformers' `Seq2SeqTrainer` with hf_accum's exact accumulation and memory-planned batches.

    from hf_accum import AccumSeq2SeqTrainer, AccumSeq2SeqTrainingArguments
    # was: from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    args = AccumSeq2SeqTrainingArguments(output_dir="out", target_batch_size=16, predict_with_generate=True, ...)
    trainer = AccumSeq2SeqTrainer(model=model, args=args, train_dataset=train, eval_dataset=dev,
                                  data_collator=DataCollatorForSeq2Seq(tokenizer, model=model))

`AccumSeq2SeqTrainingArguments` is `Seq2SeqTrainingArguments` + `AccumTrainingArguments` (one dataclass: every
field of both is a keyword and a CLI flag for `HfArgumentParser`, so transformers' run_summarization.py and
run_translation.py take it by swapping two names). Training: the loss of an optimizer step is the sum of the
target (decoder label) tokens' losses over the whole window divided by their number (encoder-decoder labels are
not shifted: every label but -100 counts), also for models whose `forward` ignores `num_items_in_batch` (BART,
T5), where `Seq2SeqTrainer` alone steps with the sum of the micro-batch means.

Evaluation with ``predict_with_generate``: the eval batch (`auto_eval_batch_size`) is measured with the generation
`evaluate` runs, held to its full length, and the generated tokens kept; an OOM re-runs the failed batch in halves.
The loss of a generating step is the model's own batch mean (`Seq2SeqTrainer.prediction_step` does not call
`compute_loss`), so its ``eval_loss`` is transformers' value, said once; loss-only evaluation's is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from ..args import AccumTrainingArguments
from ..compat import seq2seq_internals
from .mixin import AccumulationMixin


@dataclass
class AccumSeq2SeqTrainingArguments(Seq2SeqTrainingArguments, AccumTrainingArguments):
    """`Seq2SeqTrainingArguments` (predict_with_generate, generation_max_length, generation_num_beams,
    generation_config, sortish_sampler) with hf_accum's fields (target_batch_size, auto_tune, loss_normalization...)."""


class AccumSeq2SeqTrainer(AccumulationMixin, Seq2SeqTrainer):
    """Drop-in `transformers.Seq2SeqTrainer`; pass `AccumSeq2SeqTrainingArguments` (plain
    `Seq2SeqTrainingArguments` works too: exact token normalization, no tuning)."""

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval", **gen_kwargs):
        self._evaluation_gen_kwargs = gen_kwargs  # what the eval batch is measured with (`_plan_eval_batch`)
        return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix,
                                **gen_kwargs)

    def _plan_eval_batch(self, dataset) -> None:
        """The eval batch measured generating as this evaluation will, to full length (seq2seq_internals.py)."""
        with seq2seq_internals.generating_at_full_length(self, getattr(self, "_evaluation_gen_kwargs", {})):
            super()._plan_eval_batch(dataset)


__all__ = ["AccumSeq2SeqTrainer", "AccumSeq2SeqTrainingArguments"]
