"""Settings that used to be dropped without a word (issue 27, point 4): a micro-batch / accumulation given with a
target under auto_tune, an empty training example, a negative max_steps. Each is refused with one line naming the
fix, or warned about at warning level where it changes nothing."""

import json
import logging

import pytest

from hf_accum import AccumTrainingArguments, recipes
from hf_accum.cli import main
from hf_accum.recipes.config import RecipeError, load_recipe
from tests.exactness import lm_examples
from tests.trainer.test_refused_before_probe import refused_untouched, trainer_for


def args(tmp_path, **kw):
    return AccumTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)


def test_an_accumulation_that_contradicts_the_target_is_refused(tmp_path):
    with pytest.raises(ValueError) as info:
        args(tmp_path, target_batch_size=16, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert str(info.value) == (
        "per_device_train_batch_size=4 x gradient_accumulation_steps=2 x world size=1 = 8 contradicts "
        "target_batch_size=16, and auto_tune plans both itself. Drop per_device_train_batch_size and "
        "gradient_accumulation_steps (probe_max_micro_batch=N caps the micro-batch), or set auto_tune=False with "
        "values that multiply to the target.")


@pytest.mark.parametrize("given,expected", [
    ({"per_device_train_batch_size": 4},
     "per_device_train_batch_size=4 is not used (the effective batch is the target either way). To cap the "
     "micro-batch, set probe_max_micro_batch=4. Set auto_tune=False to use them as given."),
    ({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
     "per_device_train_batch_size=4 and gradient_accumulation_steps=2 are not used"),
])
def test_harmless_batch_settings_are_warned_about_at_warning_level(tmp_path, caplog, given, expected):
    trainer = trainer_for(tmp_path / "out", lm_examples(16), **given)  # target 8
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer.tune()
    warned = [r for r in caplog.records if "auto_tune plans the micro-batch" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING and expected in warned[0].getMessage()


def test_defaults_say_nothing(tmp_path, caplog):
    trainer = trainer_for(tmp_path / "out", lm_examples(16))
    with caplog.at_level(logging.INFO, logger="hf_accum"):
        trainer.tune()
    assert "auto_tune plans the micro-batch" not in caplog.text


@pytest.mark.parametrize("steps", [-3, -2, 0])
def test_a_max_steps_that_is_no_step_count_is_refused(tmp_path, steps, capsys):
    message = (f"max_steps={steps} is not a number of steps: set a positive max_steps to stop after that many "
               "optimizer steps, or -1 (the default) to train num_train_epochs epochs.")
    with pytest.raises(ValueError) as info:
        args(tmp_path, max_steps=steps)
    assert str(info.value) == message
    assert main(["train", "lora_sft", f"max_steps={steps}", f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"hf-accum train: training: {message}"
    assert not (tmp_path / "run").exists()
    assert args(tmp_path, max_steps=-1).max_steps == -1


def test_an_empty_example_is_refused_naming_its_row(tmp_path):
    rows = lm_examples(16)
    rows[11] = {"input_ids": [], "labels": []}
    out = tmp_path / "out"
    refused_untouched(trainer_for(out, rows), out, r"train_dataset row 11 is empty \(input_ids has 0 tokens\): there "
                                                    r"is nothing in it to train on\. Remove empty examples")
    assert not out.exists()


@pytest.mark.parametrize("recipe,row,message", [
    ("lora_sft", {"prompt": "say hi", "response": "  "}, "has an empty response (data.response_field='response')"),
    ("lora_sft", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
     "has an empty assistant turn (the last message of data.messages_field='messages')"),
    ("lora_dpo", {"prompt": "say hi", "chosen": "hi", "rejected": ""},
     "has an empty rejected response (data.rejected_field='rejected')"),
    ("lora_classification", {"text": "", "label": 1}, "has an empty text (data.text_field='text')"),
])
def test_an_empty_recipe_row_is_refused_naming_it(tmp_path, recipe, row, message):
    good = {"lora_sft": {"prompt": "a", "response": "b"}, "lora_dpo": {"prompt": "a", "chosen": "b", "rejected": "c"},
            "lora_classification": {"text": "a", "label": 0}}[recipe]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [good, good, row, good]))
    loaded = load_recipe(recipe, [f"dataset={path}"])
    tokenizer = recipes.build_tokenizer(loaded)
    with pytest.raises(RecipeError) as info:
        recipes.build_data(loaded, tokenizer)
    assert str(info.value) == (f"data.dataset={str(path)!r} row 2 (counting from 0) {message}: there is nothing in "
                               "it to train on; fill in or remove that row")
