"""Pins compat/seq2seq_internals.py: `Seq2SeqTrainer.evaluate` / `predict` store their generation kwargs in
``_gen_kwargs`` by the rule `evaluation_generation_kwargs` repeats, and `prediction_step` generates with them;
`full_length` holds generation to its length limit."""

import pytest
import torch
from transformers import GenerationConfig, Seq2SeqTrainer, Seq2SeqTrainingArguments

from hf_accum.compat import seq2seq_internals
from tests.exactness import pad_collate, seq2seq_examples, tiny_bart


@pytest.mark.parametrize("given", [{}, {"max_new_tokens": 5}, {"max_length": 7, "num_beams": 1}])
def test_evaluate_stores_the_generation_kwargs_by_the_rule_we_repeat(tmp_path, given):
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), predict_with_generate=True, generation_max_length=11,
                                    generation_num_beams=2, use_cpu=True, report_to=[], remove_unused_columns=False)
    data = seq2seq_examples(4, seed=1)
    trainer = Seq2SeqTrainer(model=tiny_bart(torch.float32), args=args, eval_dataset=data, data_collator=pad_collate,
                             compute_metrics=lambda p: {})
    want = seq2seq_internals.evaluation_generation_kwargs(trainer, given)
    trainer.evaluate(**given)
    assert trainer._gen_kwargs == want
    with seq2seq_internals.generating_at_full_length(trainer, given) as kwargs:
        assert trainer._gen_kwargs is kwargs
        out = trainer.prediction_step(trainer.model, pad_collate(data), prediction_loss_only=False)
    assert trainer._gen_kwargs == want  # restored
    longest = given.get("max_new_tokens", 0) + 1 or given.get("max_length") or 11
    assert out[1].shape[-1] >= longest and (out[1][:, :longest] != 0).all()  # no padding: generated to the limit


def test_full_length_holds_each_kind_of_limit():
    config = GenerationConfig()
    assert seq2seq_internals.full_length({"max_new_tokens": 4}, config)["min_new_tokens"] == 4
    assert seq2seq_internals.full_length({"max_length": 9}, config) == {"max_length": 9, "min_length": 9}
    assert seq2seq_internals.full_length({}, GenerationConfig(max_new_tokens=3)) == {"min_new_tokens": 3}
    assert seq2seq_internals.full_length({}, config) == {"max_length": 20, "min_length": 20}
