"""`AccumTrainingArguments`: parsed by HfArgumentParser from flags and YAML; bad values fail early and say the fix."""

import dataclasses
import re

import pytest
import torch
from transformers import HfArgumentParser

from hf_accum import AccumTrainer, AccumTrainingArguments

from .exactness import lm_examples, tiny_llama


def make(tmp_path, **kw):
    return AccumTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)


def test_cli_flags_and_yaml(tmp_path):
    parser = HfArgumentParser(AccumTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--target_batch_size", "8", "--per_device_train_batch_size", "2",
         "--gradient_accumulation_steps", "4", "--loss_normalization", "samples", "--use_cpu", "true"]
    )
    assert (args.target_batch_size, args.loss_normalization) == (8, "samples")
    yaml_file = tmp_path / "args.yaml"
    yaml_file.write_text(f"output_dir: {tmp_path}\ntarget_batch_size: 6\nper_device_train_batch_size: 3\n"
                         "gradient_accumulation_steps: 2\nuse_cpu: true\ncheck_accumulation: true\n")
    (args,) = parser.parse_yaml_file(str(yaml_file))
    assert (args.target_batch_size, args.check_accumulation, args.loss_normalization) == (6, True, "tokens")
    with pytest.raises(SystemExit):  # argparse rejects an unknown choice before anything else runs
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--loss_normalization", "mean"])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"target_batch_size": 10, "per_device_train_batch_size": 4, "auto_tune": False},
         "pick a per_device_train_batch_size that divides 10"),
        ({"target_batch_size": 8, "per_device_train_batch_size": 2, "auto_tune": False},
         "Set gradient_accumulation_steps=4"),
        ({"target_batch_size": 0}, "target_batch_size=0 must be a positive integer"),
        ({"target_batch_size": -8}, "target_batch_size=-8 must be a positive integer"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size=0 must be a positive integer"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0 must be a positive integer"),
        ({"loss_normalization": "mean"}, "loss_normalization='mean' is not one of"),
        ({"check_accumulation_tolerance": 0.0}, "check_accumulation_tolerance=0.0 must be > 0"),
        ({"check_accumulation_tolerance": "1e-4"}, "check_accumulation_tolerance='1e-4' must be > 0"),
        ({"target_batch_size": "32"}, "target_batch_size='32' must be a positive integer"),
        ({"target_batch_size": 32.0}, "target_batch_size=32.0 must be a positive integer"),
        ({"check_accumulation": "yes"}, "check_accumulation='yes' must be True or False"),
        ({"loss_normalization": None}, "loss_normalization=None is not one of"),
        ({"num_train_epochs": 0}, "num_train_epochs=0 with max_steps=-1 trains nothing"),
        ({"num_train_epochs": -2.5}, "num_train_epochs=-2.5 with max_steps=-1 trains nothing"),
        ({"learning_rate": -1}, "learning_rate=-1 is negative"),
        ({"learning_rate": float("nan")}, "learning_rate=nan is not a finite number"),
        ({"grow_back_steps": -1}, "grow_back_steps=-1 must be an integer >= 0"),
        ({"grow_back_steps": 2.5}, "grow_back_steps=2.5 must be an integer >= 0"),
        ({"save_steps": -5}, "save_steps=-5 is negative: give a number of optimizer steps"),
        ({"eval_steps": -1}, "eval_steps=-1 is negative: give a number of optimizer steps"),
        ({"logging_steps": -0.5}, "logging_steps=-0.5 is negative: give a number of optimizer steps"),
        ({"save_total_limit": -1}, "save_total_limit=-1 is negative: give how many checkpoints to keep"),
    ],
)
def test_bad_arguments_say_the_fix(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        make(tmp_path, **kwargs)


def test_zero_epochs_are_fine_when_max_steps_decides(tmp_path):
    assert make(tmp_path, num_train_epochs=0, max_steps=3).max_steps == 3  # max_steps overrides the epochs
    assert make(tmp_path, learning_rate=0.0).learning_rate == 0.0  # frozen weights: a valid (if odd) run


def test_consistent_target_is_accepted(tmp_path):
    args = make(tmp_path, target_batch_size=12, per_device_train_batch_size=3, gradient_accumulation_steps=4,
                auto_tune=False)
    assert args.effective_batch_size == 12


def test_with_auto_tune_the_batch_settings_are_outputs(tmp_path):
    args = make(tmp_path, target_batch_size=10, per_device_train_batch_size=4)  # no error: the tuner decides
    assert args.tunes


def _train(tmp_path, data, **kw):
    args = make(tmp_path, per_device_train_batch_size=2, max_steps=1, save_strategy="no", disable_tqdm=True,
                remove_unused_columns=False, **kw)
    from .exactness import pad_collate

    def collate(examples):
        batch = pad_collate(examples)
        return batch if data != "no_labels" else {k: v for k, v in batch.items() if k != "labels"}

    examples = lm_examples(4) if data != "all_masked" else [
        {"input_ids": e["input_ids"], "labels": [-100] * len(e["labels"])} for e in lm_examples(4)
    ]
    trainer = AccumTrainer(model=tiny_llama(torch.float32), args=args, train_dataset=examples, data_collator=collate)
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    return trainer, weights


@pytest.mark.parametrize(
    "data,message",
    [("no_labels", "needs a 'labels' tensor in every batch"), ("all_masked", "Every label of the training set is ignored")],
)
def test_batches_without_labels_fail_before_any_forward(tmp_path, data, message):
    trainer, weights = _train(tmp_path, data)
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert all(torch.equal(p, w) for p, w in zip(trainer.model.parameters(), weights))  # nothing changed


def test_auto_find_batch_size_is_refused_when_hf_accum_plans_the_batch(tmp_path):
    with pytest.raises(ValueError, match="auto_find_batch_size=True cannot be combined with target_batch_size.*"
                                          "set auto_find_batch_size=False"):
        AccumTrainingArguments(output_dir=str(tmp_path), target_batch_size=8, auto_find_batch_size=True,
                               use_cpu=True)
    # without a target hf_accum plans nothing: transformers' option stays available
    assert AccumTrainingArguments(output_dir=str(tmp_path), auto_find_batch_size=True, use_cpu=True).auto_find_batch_size


# --- checkpoint_layers: "auto" unless the user set checkpointing; explicit values obeyed ---------------------------
def _ckpt_args(**kw):
    return AccumTrainingArguments(output_dir="unused", use_cpu=True, report_to=[], **kw)


@pytest.mark.parametrize("given,choice", [
    ({}, "auto"),
    ({"gradient_checkpointing": False}, False),
    ({"gradient_checkpointing": True}, True),
    ({"checkpoint_layers": "auto"}, "auto"),
    ({"checkpoint_layers": "3"}, 3),
    ({"checkpoint_layers": 0}, 0),
    ({"checkpoint_layers": 0, "gradient_checkpointing": False}, 0),
])
def test_checkpointing_setting(given, choice):
    args = _ckpt_args(**given)
    assert args.checkpointing_choice == choice
    assert dataclasses.replace(args).checkpointing_choice == choice  # a copy of resolved arguments means the same


def test_checkpointing_setting_unset_is_told_from_false_by_the_parser(tmp_path):
    parser = HfArgumentParser(AccumTrainingArguments)
    base = ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none"]
    seen = {}
    for extra in ([], ["--gradient_checkpointing"], ["--gradient_checkpointing", "false"], ["--checkpoint_layers", "2"]):
        (args,) = parser.parse_args_into_dataclasses(base + extra)
        seen[" ".join(extra)] = args.checkpointing_choice
    assert seen == {"": "auto", "--gradient_checkpointing": True, "--gradient_checkpointing false": False,
                    "--checkpoint_layers 2": 2}
    path = tmp_path / "a.yaml"
    path.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nreport_to: []\ncheckpoint_layers: 3\n")
    (args,) = parser.parse_yaml_file(str(path))
    assert args.checkpointing_choice == 3


@pytest.mark.parametrize("given,message", [
    ({"checkpoint_layers": "some"}, "checkpoint_layers='some' must be 'auto' or an integer >= 0"),
    ({"checkpoint_layers": -1}, "checkpoint_layers=-1 must be"),
    ({"checkpoint_layers": True}, "checkpoint_layers=True must be"),
    ({"checkpoint_layers": 2, "gradient_checkpointing": True}, "contradict each other"),
    # issue 59, item 10: False is obeyed, as True is (one layer checkpointed silently before)
    ({"checkpoint_layers": 1, "gradient_checkpointing": False},
     "checkpoint_layers=1 and gradient_checkpointing=False (no layer) contradict each other"),
])
def test_bad_checkpointing_setting(given, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _ckpt_args(**given)


def test_trl_default_checkpointing_counts_as_unset():
    pytest.importorskip("trl")
    from hf_accum.trl import AccumDPOConfig, AccumSFTConfig

    for config in (AccumSFTConfig, AccumDPOConfig):
        assert config(output_dir="unused", use_cpu=True, report_to=[], bf16=False).checkpointing_choice == "auto"
        explicit = config(output_dir="unused", use_cpu=True, report_to=[], bf16=False, gradient_checkpointing=True)
        assert explicit.checkpointing_choice is True
