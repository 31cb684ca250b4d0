"""The lora_dpo recipe, exactly as shipped, through the `hf-accum train` entry point (CPU, offline): preference
pairs go through `AccumDPOTrainer` with sample (pair) normalization and the sigmoid loss, the loss falls, every
adapter parameter receives a gradient, and the saved adapter reloads onto a fresh base with the same logits."""

import json
import os

import pytest
import torch

pytest.importorskip("trl")


from hf_accum import recipes, tiny  # noqa: E402
from hf_accum.cli import main  # noqa: E402
from hf_accum.recipes import run as recipe_run  # noqa: E402
from tests.recipes.test_recipes import GradientsSeen  # noqa: E402

# One xdist worker runs these tests (--dist loadgroup): `dpo` is built once, not on each.
pytestmark = pytest.mark.xdist_group("test_recipe_dpo")


@pytest.fixture(scope="module")
def dpo(tmp_path_factory):
    """`main(["train", "lora_dpo", ...])`, with the run the CLI started kept for inspection."""
    out = tmp_path_factory.mktemp("lora_dpo")
    seen, runs = GradientsSeen(), []
    original = recipe_run.run_recipe

    def keep(recipe, overrides=(), **kwargs):
        runs.append(original(recipe, overrides, callbacks=[seen], **kwargs))
        return runs[-1]

    mp = pytest.MonkeyPatch()
    mp.setattr(recipe_run, "run_recipe", keep)
    torch_threads = torch.get_num_threads()
    try:
        assert main(["train", "lora_dpo", f"output_dir={out}", "disable_tqdm=true"]) == 0
    finally:
        mp.undo()
        torch.set_num_threads(torch_threads)
    return runs[0], seen, out


def test_the_recipe_is_dpo_with_pairs_as_samples_and_the_sigmoid_loss():
    recipe = recipes.load_recipe("lora_dpo")
    args = recipe.validate()
    from hf_accum.trl import AccumDPOConfig

    assert isinstance(args, AccumDPOConfig)
    assert args.loss_normalization == "samples" and args.loss_type == ["sigmoid"]
    assert not args.bf16 and args.use_cpu and args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert recipe.data.dataset == "tiny" and recipe.model.name == "tiny"
    assert recipe.lora_config().task_type == "CAUSAL_LM"


def test_a_dpo_key_is_refused_for_an_sft_recipe():
    for name in ("lora_sft", "lora_classification"):
        with pytest.raises(recipes.RecipeError, match="unknown key 'beta'"):
            recipes.load_recipe(name, ["beta=0.1"])
    assert recipes.load_recipe("lora_dpo", ["beta=0.2"]).training["beta"] == 0.2


def test_generated_pairs_differ_only_in_content():
    for row in tiny.generate_preference_data(200, seed=1):
        chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
        assert chosen != rejected and len(chosen) == len(rejected)
        assert row["prompt"][0]["role"] == "user" and row["chosen"][0]["role"] == "assistant"


def test_the_run_is_dpo_planned_with_accumulation_and_its_loss_falls(dpo):
    run, _, out = dpo
    from hf_accum.trl import AccumDPOTrainer

    assert isinstance(run.trainer, AccumDPOTrainer)
    plan = run.summary["plan"]
    assert plan["gradient_accumulation_steps"] > 1
    assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] * plan["world_size"] == 16
    with open(os.path.join(out, recipes.SUMMARY_FILE)) as f:
        summary = json.load(f)
    assert summary["loss_normalization"] == "samples" and summary["steps"] == 60
    losses = [h["loss"] for h in summary["losses"]]
    assert abs(losses[0] - 0.693) < 0.05, losses  # policy = reference at the start: -log sigmoid(0) = ln 2
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < first - 0.15, losses
    accuracy = [h["rewards/accuracies"] for h in run.trainer.state.log_history if "rewards/accuracies" in h]
    assert accuracy[-1] > 0.75, accuracy  # the chosen answer has the higher reward on most pairs


def test_every_adapter_parameter_received_a_gradient(dpo):
    run, seen, _ = dpo
    adapter = {n for n, p in run.model.named_parameters() if p.requires_grad}
    assert adapter and all("lora_" in n for n in adapter)
    targets = set(run.recipe.lora["target_modules"])
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in adapter} == targets  # every target has an adapter
    assert adapter == seen.names, sorted(adapter - seen.names)


def test_the_saved_adapter_reloads_onto_a_fresh_base_with_the_same_logits(dpo):
    run, _, out = dpo
    reloaded, tok = recipes.load_trained(str(out))
    assert reloaded is not run.model
    texts = [tok.apply_chat_template(r["prompt"] + r["chosen"], tokenize=False)
             for r in tiny.generate_preference_data(4, seed=7)]
    batch = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    run.model.eval()
    reloaded.eval()
    with torch.no_grad():
        want, got = run.model(**batch).logits, reloaded(**batch).logits
        with run.model.disable_adapter():
            base = run.model(**batch).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not torch.allclose(base, want, atol=1e-3)  # the adapter changed the model


def test_a_local_jsonl_file_of_pairs_with_other_column_names_trains(tmp_path):
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for r in tiny.generate_instruction_data(24, seed=5):
            f.write(json.dumps({"question": r["prompt"], "good": r["response"], "bad": r["response"][::-1] + "x"}) + "\n")
    common = [f"dataset={tmp_path / 'pairs.jsonl'}", "max_steps=2", "disable_tqdm=true", "auto_tune=false",
              "per_device_train_batch_size=4", "gradient_accumulation_steps=4"]
    with pytest.raises(recipes.RecipeError, match="set them to your column names"):
        recipes.run_recipe("lora_dpo", [*common, f"output_dir={tmp_path / 'refused'}"], say=lambda _msg: None)
    assert not (tmp_path / "refused").exists()
    run = recipes.run_recipe("lora_dpo", [*common, "prompt_field=question", "chosen_field=good", "rejected_field=bad",
                                          f"output_dir={tmp_path / 'out'}"], say=lambda _msg: None)
    assert run.summary["examples"] == 24 and run.summary["steps"] == 2
    row = run.trainer.train_dataset[0]
    first = tiny.generate_instruction_data(1, seed=5)[0]
    assert run.tokenizer.decode(row["chosen_ids"]) == first["response"] + run.tokenizer.eos_token  # TRL adds eos


def test_data_max_length_is_refused_where_trl_truncates():
    for name in ("lora_sft", "lora_dpo"):
        with pytest.raises(recipes.RecipeError, match="set training.max_length instead"):
            recipes.load_recipe(name, ["data.max_length=32"])
    assert recipes.load_recipe("lora_classification", ["data.max_length=32"]).data.max_length == 32
