"""The lora_grpo recipe, exactly as shipped, through the `hf-accum train` entry point (CPU, offline): prompts of the
generated addition task go through `AccumGRPOTrainer` with LoRA, a planned layout (the plan line, forwards of whole
completions) and the two rewards, and the mean reward of the last 10 steps is above the first 10's."""

import json
import os
import time

import pytest
import torch

pytest.importorskip("trl")

from hf_accum import recipes, tiny  # noqa: E402
from hf_accum.cli import main  # noqa: E402
from hf_accum.recipes import rewards  # noqa: E402
from hf_accum.recipes import run as recipe_run  # noqa: E402

# One xdist worker runs these tests (--dist loadgroup): `grpo` is built once, not on each.
pytestmark = pytest.mark.xdist_group("test_recipe_grpo")


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    """`main(["train", "lora_grpo", ...])`, with the run the CLI started kept for inspection, and its wall time."""
    out = tmp_path_factory.mktemp("lora_grpo")
    runs, said = [], []
    original = recipe_run.run_recipe

    def keep(recipe, overrides=(), **kwargs):
        kwargs["say"] = said.append
        runs.append(original(recipe, overrides, **kwargs))
        return runs[-1]

    mp = pytest.MonkeyPatch()
    mp.setattr(recipe_run, "run_recipe", keep)
    torch_threads = torch.get_num_threads()
    start = time.perf_counter()
    try:
        assert main(["train", "lora_grpo", f"output_dir={out}", "disable_tqdm=true"]) == 0
    finally:
        mp.undo()
        torch.set_num_threads(torch_threads)
    return runs[0], said, out, time.perf_counter() - start


def test_the_recipe_is_grpo_over_completions_with_lora_and_the_dapo_token_mean():
    recipe = recipes.load_recipe("lora_grpo")
    args = recipe.validate()
    from hf_accum.trl import AccumGRPOConfig

    assert isinstance(args, AccumGRPOConfig)
    assert args.loss_type == "dapo" and args.loss_normalization == "tokens" and args.beta == 0.0
    assert args.target_batch_size == 32 and args.num_generations == 8 and args.tunes
    assert recipe.data.dataset == "tiny" and recipe.model.name == "tiny" and recipe.model.task == "grpo"
    assert recipe.lora_config().task_type == "CAUSAL_LM"


def test_the_rewards_check_the_answer_and_its_form():
    completions = [[{"role": "assistant", "content": "82"}], [{"role": "assistant", "content": "83"}], "x8a"]
    assert rewards.correct_answer(completions, answer=["82"] * 3) == [1.0, 0.25, 0.0]
    assert rewards.answer_format(["82", " 7 ", "8a", "1234", ""]) == [0.5, 0.5, 0.125, 0.25, 0.0]
    rows = tiny.generate_arithmetic_prompts(50, seed=2)
    assert all(int(a) + int(b) == int(r["answer"]) for r in rows
               for a, b in [r["prompt"].removeprefix("add ").split(" and ")])


def test_the_run_plans_forwards_of_completions_and_the_mean_reward_rises(grpo):
    run, said, out, seconds = grpo
    from hf_accum.trl import AccumGRPOTrainer

    assert isinstance(run.trainer, AccumGRPOTrainer)
    plan = run.summary["plan"]
    assert plan["target_batch_size"] == 32 and plan["world_size"] == 1
    assert 1 < run.trainer.plan.micro_batch_size < 32  # more than one forward per generation batch
    assert any(line.startswith("data tiny: 2000 prompts") for line in said), said
    assert any(line.startswith("mean reward ") for line in said), said
    with open(os.path.join(out, recipes.SUMMARY_FILE)) as f:
        summary = json.load(f)
    assert summary["steps"] == 40 and summary["loss_normalization"] == "tokens"
    assert len(summary["rewards"]) == 40
    assert summary["last_rewards_mean"] > summary["first_rewards_mean"] + 0.1, summary["rewards"]
    assert seconds < 120
