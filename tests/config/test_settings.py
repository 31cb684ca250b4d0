"""settings.Settings: the batch the arguments give and the exact target, derived in one place."""

from __future__ import annotations

import pytest
from transformers import TrainingArguments

from hf_accum.args import AccumTrainingArguments
from hf_accum.config.settings import Settings


@pytest.mark.parametrize("micro, accumulation, target, world, given, exact", [
    (4, 2, None, None, 8, 8),  # the arguments' own world size (1 here)
    (4, 2, None, 3, 24, 24),
    (4, 2, 16, 3, 24, 16),  # a target wins over what the batch settings give
    (3, 5, None, 1, 15, 15),  # world=1: one rank's window
])
def test_given_batch_and_exact_target(tmp_path, micro, accumulation, target, world, given, exact):
    args = AccumTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                  per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation)
    args.target_batch_size = target  # set after the checks: this reads the copy as the planner leaves it
    settings = Settings(args)
    assert settings.given_batch(world) == given and settings.exact_target(world) == exact
    assert args.effective_batch_size == micro * accumulation  # one process


def test_plain_training_arguments_have_no_target(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2,
                             gradient_accumulation_steps=3)
    assert Settings(args).target_batch_size is None and Settings(args).exact_target() == 6
