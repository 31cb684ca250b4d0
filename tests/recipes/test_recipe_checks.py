"""The pure checks behind the CLI's one-line errors: value types against dataclass fields (recipes/values.py) and
what the output directory and resume_from_checkpoint decide before any model work (recipes/preflight.py)."""

import enum
import json
import os
import re
from typing import Any, Literal

import pytest
import torch

from hf_accum.recipes import RecipeError, preflight, rules, values
from hf_accum.recipes.preflight import PLAN_FILE


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@pytest.mark.parametrize("value,hint,ok", [
    (1e-4, float, True), (3, float, True), ("abc", float, False), (True, float, False),
    (3, int, True), (3.0, int, False), (True, int, False), ("3", int, False),
    (True, bool, True), ("yes", bool, False), (0, bool, False),
    ("x", str, True), (None, str, False), (None, int | None, True), (2, int | None, True),
    ("x", str | bool, True), (False, str | bool, True), (1.5, str | bool, False),
    (["a", "b"], list[str], True), (["a", 1], list[str], False), ("a", list[str], False),
    ("all-linear", str | list[str] | None, True), (3, str | list[str] | None, False),
    ({"a": 1}, dict[str, Any], True), ([1], dict[str, Any], False),
    ("red", Color, True), ("green", Color, False), ("red", Color | str, True), ("green", Color | str, False),
    ("none", Literal["none", "all"], True), ("some", Literal["none", "all"], False),
    (object(), Any, True),
])
def test_fits(value, hint, ok):
    assert values.fits(value, hint) is ok


@pytest.mark.parametrize("hint,text", [
    (float, "a number"), (int | None, "an integer or null"), (bool, "true or false"),
    (str | list[str] | None, "a list of strings or a string or null"), (Color | str, "one of 'red', 'blue'"),
    (list[str] | str | None, "a list of strings or a string or null"), (int | float, "a number or an integer"),
    (Literal["none", "all"], "one of 'none', 'all'"), (dict[str, Any], "a mapping"),
])
def test_describe(hint, text):
    assert values.describe(hint) == text


def test_field_types_resolve_every_field_of_the_sections():
    import dataclasses

    from peft import LoraConfig

    from hf_accum.args import AccumTrainingArguments

    for cls in (AccumTrainingArguments, LoraConfig):
        assert set(values.field_types(cls)) >= {f.name for f in dataclasses.fields(cls) if f.init}
    assert values.field_types(AccumTrainingArguments)["learning_rate"] is float


# --- the output directory and resume ---------------------------------------------------------------------------
def plan_file(folder, target):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, PLAN_FILE), "w") as f:
        json.dump({"plan": {"micro_batch_size": 4, "gradient_accumulation_steps": target // 4, "world_size": 1,
                            "target_batch_size": target}, "key": {}, "probe": None}, f)


def checkpoint(out, step, target=16, complete=True, weights_only=False):
    folder = os.path.join(out, f"checkpoint-{step}")
    os.makedirs(folder)
    if complete:
        with open(os.path.join(folder, "trainer_state.json"), "w") as f:
            json.dump({"global_step": step}, f)
        plan_file(folder, target)
        for name in () if weights_only else ("optimizer.pt", "scheduler.pt"):  # what transformers loads
            torch.save({}, os.path.join(folder, name))  # a readable archive (an empty file is a broken one)
    return folder


def test_an_output_dir_planned_for_another_target_is_refused(tmp_path):
    out = str(tmp_path / "run")
    preflight.check_output_dir(out, 16)  # absent: fine (created later, by the run)
    plan_file(out, 16)
    preflight.check_output_dir(out, 16)
    with pytest.raises(RecipeError, match=r"holds a run planned for target_batch_size=16 .* asks for "
                                          r"target_batch_size=32; keep target_batch_size=16 .* output_dir=ANOTHER_DIR"):
        preflight.check_output_dir(out, 32)
    (tmp_path / "file").write_text("x")
    with pytest.raises(RecipeError, match="is a file; pass output_dir=DIR"):
        preflight.check_output_dir(str(tmp_path / "file"), 16)


def test_resume_values(tmp_path):
    out = str(tmp_path / "run")
    assert preflight.resolve_resume(None, out, 16) is None and preflight.resolve_resume(False, out, 16) is None
    with pytest.raises(RecipeError, match="holds no complete checkpoint"):
        preflight.resolve_resume(True, out, 16)
    checkpoint(out, 2)
    newest = checkpoint(out, 10)
    checkpoint(out, 12, complete=False)  # a kill while saving: passed over
    checkpoint(out, 14, weights_only=True)  # save_only_model=True: no optimizer state to resume, passed over
    assert preflight.resolve_resume(True, out, 16) == newest
    assert preflight.resolve_resume(newest, out, 16) == newest
    with pytest.raises(RecipeError, match=r"holds checkpoints of an earlier run \(newest: checkpoint-14\).*"
                                          "resume_from_checkpoint=true"):
        preflight.resolve_resume(None, out, 16)
    with pytest.raises(RecipeError, match="no such checkpoint directory"):
        preflight.resolve_resume(str(tmp_path / "nope"), out, 16)
    with pytest.raises(RecipeError, match=r"trained with target_batch_size=16, but target_batch_size=8 now"):
        preflight.resolve_resume(True, out, 8)


def test_resume_true_with_no_complete_checkpoint_names_the_bad_file_and_a_way_out_that_works(tmp_path):
    """Issue 59, item 12: the only checkpoint's optimizer.pt is cut short. The refusal names that file, and its way
    out (another output_dir) is one the next run takes: "leave it unset" was refused there, pointing back here."""
    out = str(tmp_path / "run")
    folder = checkpoint(out, 2)
    torch.save({"state": list(range(1000))}, os.path.join(folder, "optimizer.pt"))
    with open(os.path.join(folder, "optimizer.pt"), "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    with pytest.raises(RecipeError) as refused:
        preflight.resolve_resume(True, out, 16)
    message = str(refused.value)
    assert re.search(r"holds no complete checkpoint \(checkpoint-2: its file optimizer\.pt: .*truncated", message)
    assert message.endswith("start over with output_dir=ANOTHER_DIR (these folders stay as they are)")
    assert preflight.resolve_resume(None, str(tmp_path / "another"), 16) is None  # the way out runs
    # by path: refused here, before any model is built (issue 59, item 14: it was built and the data tokenized first)
    with pytest.raises(RecipeError, match=r"cannot be resumed: its file optimizer\.pt: .*truncated.*"
                                          r"resume_from_checkpoint=true picks the newest complete checkpoint"):
        preflight.resolve_resume(folder, out, 16)


@pytest.mark.parametrize("damage", ["trainer_state.json", "optimizer.pt"])
def test_resume_true_names_the_newer_checkpoint_it_skips_and_why(tmp_path, caplog, damage):
    """`hf-accum train ... resume_from_checkpoint=true` passes over a newer checkpoint that would not load, and says
    which and why (it used to resume the older one without a word)."""
    import logging

    out = str(tmp_path / "run")
    good = checkpoint(out, 2)
    newer = checkpoint(out, 4)
    with open(os.path.join(newer, damage), "r+b") as f:
        f.truncate(7)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        assert preflight.resolve_resume(True, out, 16) == good
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"hf_accum: skipping {newer}: ")
    assert damage in lines[0]


def untokenized():
    from hf_accum.recipes.data import RecipeData

    return RecipeData(None, None, None, 0.0, 0.0, 0, eval_dataset=["kept"])


@pytest.mark.parametrize("rows,tokens,targets,longest", [
    ([{"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}], 4.0, 2.0, 4),  # TRL's labels column
    ([{"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1]}], 4.0, 2.0, 4),  # completion mask only
    ([{"input_ids": [1, 2], "labels": [5, -100]}, {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}], 2.5, 1.0, 3),
])
def test_sft_stats_count_predicted_targets(rows, tokens, targets, longest):
    from datasets import Dataset

    from hf_accum.recipes import sft_stats

    out = sft_stats(untokenized(), Dataset.from_list(rows))  # position 0 is never predicted (causal shift)
    assert (out.mean_tokens, out.mean_targets, out.longest) == (tokens, targets, longest)
    assert out.eval_dataset == ["kept"]  # the held-out rows travel with the statistics


def test_preference_stats_count_both_sequences_of_a_pair():
    from datasets import Dataset

    from hf_accum.recipes import preference_stats

    rows = [{"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]},
            {"prompt_ids": [1], "chosen_ids": [4], "rejected_ids": [6, 7, 8, 9]}]
    out = preference_stats(untokenized(), Dataset.from_list(rows))
    assert (out.mean_tokens, out.mean_targets, out.longest) == ((9 + 7) / 2, 1.0, 5)


# --- the types as cached (values.encode/decode) and the value rules (recipes/rules.py) --------------------------
SAMPLES = [None, True, False, 0, 3, -1, 2.5, "abc", "auto", "steps", "no", "cosine", "all-linear", ["a", "b"], [1],
           {"a": 1}]


def _every_field():
    from peft import LoraConfig

    from hf_accum.recipes.config import training_class
    from hf_accum.recipes.sections import DataSection, ModelSection

    for cls in {ModelSection, DataSection, LoraConfig, *(training_class(t) for t in ("causal_lm", "seq_cls", "dpo"))}:
        for key, hint in values.field_types(cls).items():
            yield f"{cls.__name__}.{key}", hint


def test_a_cached_type_answers_as_the_annotation_it_was_read_from():
    checked = 0
    for name, hint in _every_field():
        back = values.decode(json.loads(json.dumps(values.encode(hint))))
        assert values.describe(back) == values.describe(hint), name
        assert [values.fits(v, back) for v in SAMPLES] == [values.fits(v, hint) for v in SAMPLES], name
        checked += 1
    assert checked > 300  # every field of the sections, peft's LoraConfig and the three trainer configs


def test_the_rules_name_keys_that_exist_and_choices_the_library_takes():
    import torch

    from hf_accum.recipes import rules
    from hf_accum.recipes.config import valid_keys
    from hf_accum.window.loss import NORMALIZATIONS

    keys = {f"{s}.{k}" for task in rules.TASKS for s, ks in valid_keys(task).items() for k in ks}
    assert {rule.key for rule in rules.RULES} <= keys
    assert rules.LOSS_NORMALIZATIONS == NORMALIZATIONS
    assert all(getattr(torch, name).is_floating_point for name in rules.WEIGHT_DTYPES if name != "auto")


# A value the recipe rules refuse is refused by the arguments too (the Python API), so the table adds speed, never
# a rule of its own.
@pytest.mark.parametrize("field,value", [
    ("learning_rate", -1.0), ("learning_rate", float("nan")), ("max_steps", 0), ("max_steps", -2),
    ("target_batch_size", 0), ("per_device_train_batch_size", 0), ("gradient_accumulation_steps", 0),
    ("memory_budget_bytes", 0), ("probe_seq_len", 0), ("probe_max_micro_batch", 0), ("max_tokens_per_forward", 0),
    ("memory_budget", 1.5), ("memory_budget", 0.0), ("grow_back_steps", -1), ("checkpoint_layers", "abc"),
    ("checkpoint_layers", -1), ("loss_normalization", "mean"), ("micro_batching", "rows"),
    ("auto_tune_optimize", "speed"), ("save_steps", -5), ("eval_steps", -1), ("logging_steps", -2),
    ("save_total_limit", -1),
])
def test_what_the_rules_refuse_the_arguments_refuse(field, value, tmp_path):
    from hf_accum import AccumTrainingArguments
    from hf_accum.recipes import rules

    with pytest.raises(RecipeError, match=rf"training(\.|: ){field}="):  # max_steps speaks the arguments' words
        rules.check_values({"training": {field: value}})
    with pytest.raises(ValueError, match=f"{field}="):
        AccumTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **{field: value})


def test_num_train_epochs_zero_is_refused_only_without_max_steps():
    from hf_accum.recipes import rules

    with pytest.raises(RecipeError, match="num_train_epochs=0 with max_steps=-1 trains nothing"):
        rules.check_values({"training": {"num_train_epochs": 0, "max_steps": -1}})
    with pytest.raises(RecipeError, match="num_train_epochs=0 with max_steps=-1"):
        rules.check_values({"training": {"num_train_epochs": 0}})  # max_steps unset: -1
    rules.check_values({"training": {"num_train_epochs": 0, "max_steps": 60}})  # max_steps decides: no error


def test_a_dpo_recipe_takes_one_loss_type_as_trl_does():
    """TRL's DPOConfig takes `loss_type="sigmoid"` (its __post_init__ wraps it in a list); the recipe used to refuse
    it ("takes a list"). What the class accepts, the recipe accepts; what it refuses stays refused."""
    from trl import DPOConfig

    from hf_accum.recipes import load_recipe

    assert DPOConfig(output_dir="unused", loss_type="sigmoid", use_cpu=True, bf16=False).loss_type == ["sigmoid"]  # TRL's rule, pinned
    assert load_recipe("lora_dpo", ["loss_type=sigmoid"]).validate().loss_type == ["sigmoid"]
    assert load_recipe("lora_dpo", ["loss_type=[sigmoid,ipo]"]).validate().loss_type == ["sigmoid", "ipo"]
    assert load_recipe("lora_sft", ["loss_type=nll"]).validate().loss_type == "nll"  # SFTConfig's is a string
    with pytest.raises(RecipeError, match=r"training\.loss_type=3 is an integer, but training\.loss_type takes a "
                                          r"list of strings or a string"):
        load_recipe("lora_dpo", ["loss_type=3"])


@pytest.mark.parametrize("name", ["./no_such_model", "../no_such_model", "/no/such/model", "~/no_such_model"])
def test_a_model_name_written_as_a_path_that_does_not_exist_says_no_such_directory(name, monkeypatch):
    """Not taken for a hub id ("Set HF_HUB_OFFLINE=1", "Repo id must use alphanumeric chars"): a path, missing."""
    from hf_accum.probing.loading import load_model

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # online or not, the answer is the same
    expected = f"model.name={name!r} is a path, but there is no such directory: give the directory a model was saved to"
    with pytest.raises(RecipeError) as info:
        rules.check_values({"model": {"name": name}})
    assert str(info.value).startswith(expected)
    with pytest.raises(ValueError) as info:
        load_model(name, label="model.name")
    assert str(info.value).startswith(expected)
    rules.check_values({"model": {"name": "org/name"}})  # a hub id, and an existing path, pass
    rules.check_values({"model": {"name": "./"}})


def test_the_unknown_recipe_error_names_a_folder_that_holds_the_recipes():
    """Issue 59, item 13: the error named every folder searched, one of which a wheel install does not have."""
    from hf_accum.recipes.files import recipe_path

    with pytest.raises(RecipeError, match=r"the recipes are in (\S+)\)$") as refused:
        recipe_path("nope")
    folder = re.search(r"the recipes are in (\S+)\)$", str(refused.value)).group(1)
    assert os.path.isfile(os.path.join(folder, "lora_sft.yaml"))


def test_a_bare_max_length_goes_to_the_section_where_it_applies():
    """Issue 59, item 5: a bare `max_length=` offered data.max_length or training.max_length, then refused
    data.max_length for a TRL recipe. A bare key now resolves to the one section where it applies."""
    from hf_accum.recipes.config import resolve_key, valid_keys

    for task in ("causal_lm", "dpo", "grpo"):  # TRL's trainers truncate: training.max_length
        if "max_length" in valid_keys(task)["training"]:
            assert resolve_key("max_length", valid_keys(task)) == ("training", "max_length")
    assert resolve_key("max_length", valid_keys("seq_cls")) == ("data", "max_length")  # its own tokenizer call
