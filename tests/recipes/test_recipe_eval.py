"""A recipe's held-out rows (data.eval_examples, issue 26): the last N rows evaluate after training, with the eval
batch planned, and the summary's eval_loss equals the token mean computed by hand in float64, each held-out example
forwarded alone; bad values are refused before any work."""

import pytest
import torch

from hf_accum import recipes
from hf_accum.recipes import RecipeError, load_recipe

# One xdist worker runs these tests (--dist loadgroup): `run` is built once, not on each.
pytestmark = pytest.mark.xdist_group("test_recipe_eval")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("sft_eval")
    try:
        yield recipes.run_recipe("lora_sft", ["data.num_examples=240", "data.eval_examples=24", "max_steps=4",
                                              "disable_tqdm=true", f"output_dir={out}"], say=lambda _msg: None)
    finally:
        torch.set_num_threads(before)


def test_the_last_rows_are_held_out_and_never_trained(run):
    from hf_accum import tiny

    pairs = tiny.generate_instruction_data(240, seed=run.recipe.data.seed, long_tailed=True)
    assert len(run.trainer.train_dataset) == 216 and len(run.trainer.eval_dataset) == 24
    held = [row["completion"][0]["content"] for row in run.trainer.eval_dataset]
    assert held == [p["response"] for p in pairs[216:]]
    assert run.summary["eval_examples"] == 24 and run.summary["examples"] == 216


def test_eval_loss_is_the_token_mean_by_hand_whatever_the_planned_batch(run):
    trainer = run.trainer
    model = run.model.to(torch.float64).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in trainer.eval_dataset:  # as TRL tokenized it: the prompt is masked (completion-only loss)
            ids = torch.tensor([row["input_ids"]])
            if "labels" in row:  # TRL builds the labels column while preparing the dataset (newer: in the collator)
                mask = torch.tensor(row["labels"][1:]) != -100
            else:
                mask = torch.tensor(row["completion_mask"][1:], dtype=torch.bool)
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), dim=-1)
            nll = -logp.gather(1, ids[0, 1:, None])[:, 0]
            total += float(nll[mask].sum())
            count += int(mask.sum())
    model.to(torch.float32)
    assert count > 0
    assert run.summary["eval_batch_size"] > 1  # planned (auto_eval_batch_size), not one row per forward
    assert run.summary["eval_loss"] == pytest.approx(total / count, rel=1e-5)  # the run evaluates in float32


@pytest.mark.parametrize("overrides, message", [
    (["data.eval_examples=-1"], r"data.eval_examples=-1 must be a whole number of rows"),
    (["eval_strategy=steps"], r"training.eval_strategy=steps evaluates during training, but no rows are held out: "
                              r"set data.eval_examples=N"),
])
def test_bad_eval_settings_are_refused_when_the_recipe_loads(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe("lora_sft", overrides)


def test_holding_out_every_row_is_refused_before_the_model_is_built(tmp_path):
    with pytest.raises(RecipeError, match=r"data.eval_examples=50 leaves no training row of the 50 rows"):
        recipes.run_recipe("lora_sft", ["data.num_examples=50", "data.eval_examples=50", f"output_dir={tmp_path}/o"],
                           say=lambda _msg: None)
    assert not (tmp_path / "o").exists()


def test_evaluating_during_training_then_resuming(tmp_path):
    """eval_steps alone means eval_strategy=steps (as save_steps does for saving); the eval batch the first evaluation
    plans is not reported as a plan lowered by an out-of-memory error; the last step's evaluation is not run again
    after training; a resumed run's summary counts the steps and tokens of this run only."""
    out = tmp_path / "run"
    common = ["data.num_examples=120", "data.eval_examples=12", "eval_steps=2", "save_steps=2", "disable_tqdm=true",
              f"output_dir={out}"]
    said: list[str] = []
    first = recipes.run_recipe("lora_sft", [*common, "max_steps=4"], say=said.append)
    assert first.trainer.args.eval_strategy == "steps"
    assert not any("lowered" in line for line in said), said
    evaluations = [h for h in first.trainer.state.log_history if "eval_loss" in h]
    assert [h["step"] for h in evaluations] == [2, 4]  # the final one is reused, not run a third time
    assert first.summary["eval_loss"] == evaluations[-1]["eval_loss"]
    tokens_first = first.trainer.state.num_input_tokens_seen

    said.clear()
    resumed = recipes.run_recipe("lora_sft", [*common, "max_steps=6", "resume_from_checkpoint=true"],
                                 say=said.append)
    summary = resumed.summary
    assert summary["steps"] == 6 and summary["steps_this_run"] == 2
    assert summary["tokens_seen"] == resumed.trainer.state.num_input_tokens_seen - tokens_first > 0
    assert any(line.startswith("loss ") and "; 2 steps in" in line for line in said), said


def test_a_folder_named_like_a_recipe_does_not_hide_it(tmp_path, monkeypatch):
    (tmp_path / "lora_sft").mkdir()  # e.g. an output_dir named after the recipe, in the working directory
    monkeypatch.chdir(tmp_path)
    assert load_recipe("lora_sft").name == "lora_sft"
