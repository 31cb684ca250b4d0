"""Fails when transformers changes how `Trainer.training_step` post-processes the loss (see hf_accum/_compat.py)."""

import itertools

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_accum import _compat

from .exactness import tiny_llama


@pytest.mark.parametrize(
    "accepts,num_items,loss_func,declared",
    [c for c in itertools.product([True, False], [None, 5], [None, "f"], [None, True, False])],
)
def test_training_step_division_rule(tmp_path, accepts, num_items, loss_func, declared):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, gradient_accumulation_steps=4)
    trainer = Trainer(model=tiny_llama(torch.float32), args=args)
    trainer.model_accepts_loss_kwargs = accepts
    trainer.compute_loss_func = (lambda *a, **k: None) if loss_func else None
    if declared is not None:  # set even on versions without the attribute: they must ignore it, and so must we
        trainer.loss_is_scaled_for_ga = declared
    trainer.current_gradient_accumulation_steps = 4
    weight = next(trainer.model.parameters())
    trainer.compute_loss = lambda model, inputs, **kw: (weight.sum() * 0 + 8.0)
    returned = float(trainer.training_step(trainer.model, {"input_ids": torch.ones(1, 2, dtype=torch.long)}, num_items))
    expected = 2.0 if _compat.trainer_divides_by_accumulation(trainer, num_items) else 8.0
    assert returned == expected


def test_training_args_are_saved_before_trainer_state_and_read_without_unpickling_code(tmp_path, monkeypatch):
    # checkpoints.py knows a run's target from training_args.bin even when the plan file written after
    # trainer_state.json is lost: that needs transformers to write the arguments first.
    import os

    from transformers.trainer_callback import TrainerState

    from hf_accum import _compat

    from .test_checkpoints import trainer_for

    seen = []
    original = TrainerState.save_to_json

    def save_to_json(self, json_path):
        seen.append(_compat.saved_training_args(os.path.dirname(json_path)))
        return original(self, json_path)

    monkeypatch.setattr(TrainerState, "save_to_json", save_to_json)
    trainer_for(tmp_path / "run", micro=2, accum=2, stop=1).train()
    assert seen and seen[0]["target_batch_size"] == 4 and seen[0]["gradient_accumulation_steps"] == 2
    assert _compat.saved_training_args(str(tmp_path / "absent")) is None


def test_attn_implementation_is_read_from_the_config():
    from hf_accum import _compat
    from hf_accum.tiny import build_model

    model = build_model()
    assert _compat.attn_implementation(model) == "sdpa"
    model.set_attn_implementation("eager")
    assert _compat.attn_implementation(model) == "eager"
