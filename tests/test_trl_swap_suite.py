"""The pure parts of scripts/swap/trl_swap_suite.py and scripts/swap/trl_standins.py: which hub ids have stand-ins, the stand-in
datasets' columns per config, the modes, and which regressions are the allowed (refused, batch-dependent) loss types.
"""

import pytest

from tests.swap_scripts import load

standins = load("trl_standins")
suite = load("trl_swap_suite")


@pytest.mark.parametrize("text, missing", [
    ("OSError: no local stand-in for Qwen/Qwen3-4B", ["Qwen/Qwen3-4B"]),
    ("trl-internal-testing/tiny-Qwen2ForCausalLM-2.5 and trl-internal-testing/zen", []),
    ("load trl-internal-testing/tiny-LlavaForConditionalGeneration, then trl-internal-testing/zen-image, "
     "trl-internal-testing/zen-image again", ["trl-internal-testing/tiny-LlavaForConditionalGeneration",
                                              "trl-internal-testing/zen-image"]),
    ("a path /tmp/x/y and a version 1.2/3 are no hub ids", []),
])
def test_missing_ids_names_hub_ids_without_a_stand_in(text, missing):
    assert standins.missing_ids(text) == missing


def test_every_model_stand_in_names_a_transformers_class_with_a_matching_id():
    import transformers

    for hub_id, spec in standins.MODELS.items():
        assert spec.architecture.split("For")[0].lower() in hub_id.lower().replace("-", ""), hub_id
        assert hasattr(transformers, spec.architecture) and hasattr(transformers, spec.config), hub_id
        assert standins.has_standin(hub_id) and not standins.missing_ids(hub_id)
    assert standins.cache_dir_name("trl-internal-testing/zen", "dataset") == "datasets--trl-internal-testing--zen"


# TRL's dataset formats: the columns each "zen" config has on the hub
COLUMNS = {
    "standard_language_modeling": {"text"}, "standard_prompt_only": {"prompt"},
    "standard_prompt_completion": {"prompt", "completion"}, "standard_preference": {"prompt", "chosen", "rejected"},
    "standard_implicit_prompt_preference": {"chosen", "rejected"},
    "standard_unpaired_preference": {"prompt", "completion", "label"},
    "conversational_language_modeling": {"messages"}, "conversational_prompt_only": {"prompt"},
    "conversational_prompt_completion": {"prompt", "completion"},
    "conversational_preference": {"prompt", "chosen", "rejected"},
    "conversational_implicit_prompt_preference": {"chosen", "rejected"},
    "conversational_unpaired_preference": {"prompt", "completion", "label"},
}


@pytest.mark.parametrize("config", sorted(COLUMNS))
def test_zen_stand_in_has_the_configs_columns_and_19_rows(config):
    columns = standins.zen_columns(config)
    assert set(columns) == COLUMNS[config]
    assert {len(v) for v in columns.values()} == {19}
    first = {k: v[0] for k, v in columns.items()}
    if config.startswith("conversational"):
        assert all(isinstance(v, (list, bool)) for v in first.values())
    if "preference" in config and "unpaired" not in config:
        assert all(c != r for c, r in zip(columns["chosen"], columns["rejected"]))  # a real preference pair
    if config == "standard_preference":  # prompt + chosen is the Zen line itself
        assert first["prompt"] + first["chosen"] == "Beautiful is better than ugly."


def test_zen_stand_in_refuses_an_unknown_config_and_splits_17_2():
    with pytest.raises(KeyError, match="no stand-in for config 'standard_stepwise'"):
        standins.zen_columns("standard_stepwise")
    pytest.importorskip("datasets")
    splits = standins.load_dataset("trl-internal-testing/zen", "standard_preference")
    assert (splits["train"].num_rows, splits["test"].num_rows) == (17, 2)
    assert standins.load_dataset("trl-internal-testing/zen", "standard_prompt_only", split="test").num_rows == 2
    with pytest.raises(FileNotFoundError, match="no local stand-in for dataset stanfordnlp/imdb"):
        standins.load_dataset("stanfordnlp/imdb", split="train")


@pytest.mark.parametrize("test_id, ok", [
    ("tests/test_dpo_trainer.py::TestDPOTrainer::test_train_loss_types[aot]", True),
    ("tests/test_dpo_trainer.py::TestDPOTrainer::test_train_loss_types[aot_unpaired]", True),
    ("tests/test_dpo_trainer.py::TestDPOTrainer::test_train_loss_types[bco_pair]", True),
    ("tests/test_dpo_trainer.py::TestDPOTrainer::test_train_loss_types[aot_pair]", False),
    ("tests/test_dpo_trainer.py::TestDPOTrainer::test_train_with_components", False),
    ("tests/test_dpo_trainer.py::TestDPOTrainer::test_train_multi_loss_types", True),
    ("tests/test_dpo_trainer.py::TestDPOTrainer::test_train_loss_types[sigmoid]", False),
    ("tests/test_dpo_trainer.py::TestDPOTrainer::test_train_loss_types[sft]", False),
    ("tests/test_dpo_trainer.py::TestDPOTrainer::test_train_model", False),
    ("tests/test_aot_file.py::TestX::test_train", False),  # only the test's own name counts
    ("tests/test_grpo_trainer.py::TestGRPOTrainer::test_train_loss_types[bnpo-False]", True),  # GRPO's cut-dependent
    ("tests/test_grpo_trainer.py::TestGRPOTrainer::test_train_loss_types[bnpo-True]", True),
    ("tests/test_grpo_trainer.py::TestGRPOTrainer::test_train_loss_types[dapo-False]", False),
])
def test_only_batch_dependent_loss_types_are_allowed_regressions(test_id, ok):
    assert suite.allowed(test_id) is ok


def test_modes_and_regressions():
    assert suite.mode_env("plain") == {"HF_ACCUM_TRL_SWAP": "0", "HF_ACCUM_TRL_GA": "", "HF_ACCUM_TRL_TARGET": ""}
    assert suite.mode_env("swapped-ga3") == {"HF_ACCUM_TRL_SWAP": "1", "HF_ACCUM_TRL_GA": "3", "HF_ACCUM_TRL_TARGET": ""}
    assert suite.mode_env("swapped-target-ga2") == {"HF_ACCUM_TRL_SWAP": "1", "HF_ACCUM_TRL_GA": "2",
                                                    "HF_ACCUM_TRL_TARGET": "1"}
    assert [suite.baseline_of(m) for m in ("swapped", "swapped-target", "swapped-target-ga2", "swapped-ga3")] == [
        "plain", "plain", "plain-ga2", "plain-ga3"]
    for bad in ("ours", "swapped-gax", "plain-gaz", "plain-target", "swapped-targetx"):
        with pytest.raises(ValueError, match="expected plain, swapped or swapped-target"):
            suite.mode_env(bad)
    ours = {"a": ("failed", ""), "b": ("error", ""), "c": ("passed", ""), "d": ("failed", ""), "e": ("failed", "")}
    theirs = {"a": ("passed", ""), "b": ("skipped", ""), "c": ("failed", ""), "d": ("failed", "")}
    assert suite.regressions(ours, theirs) == ["a", "b", "e"]  # "e": TRL did not run it


def test_the_transformers_suite_modes():
    trainer_suite = load("trainer_swap_suite")
    assert trainer_suite.mode_env("plain") == {"HF_ACCUM_SWAP": "0", "HF_ACCUM_SWAP_TARGET": "0"}
    assert trainer_suite.mode_env("swapped") == {"HF_ACCUM_SWAP": "1", "HF_ACCUM_SWAP_TARGET": "0"}
    assert trainer_suite.mode_env("swapped-target") == {"HF_ACCUM_SWAP": "1", "HF_ACCUM_SWAP_TARGET": "1"}
    with pytest.raises(ValueError, match="expected one of plain, swapped, swapped-target"):
        trainer_suite.mode_env("plain-target")
