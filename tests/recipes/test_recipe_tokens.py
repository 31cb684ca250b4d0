"""A recipe with ``micro_batching=tokens``: the run tunes first (the token budget and the step-time model measured),
then trains with auto_tune off under that plan; no budget was given, and none is asked for."""

import math

import torch

from hf_accum import recipes


def test_a_recipe_in_tokens_mode_trains_on_the_budget_its_probe_measured(tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    said = []
    try:
        run = recipes.run_recipe("lora_sft", ["data.num_examples=240", "max_steps=2", "logging_steps=1",
                                              "micro_batching=tokens", "disable_tqdm=true", f"output_dir={tmp_path}"],
                                 say=said.append)
    finally:
        torch.set_num_threads(before)
    plan = run.trainer.plan
    assert plan.token_budget is not None and plan.token_budget >= max(len(r["input_ids"]) for r in
                                                                      run.trainer.train_dataset)
    assert run.trainer.args.max_tokens_per_forward is None  # measured, not given
    assert plan.step_time is None or "forward_seconds_by_rows" in plan.step_time  # the model the probe fits now
    assert run.trainer.state.global_step == 2
    losses = [entry["loss"] for entry in run.summary["losses"]]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert "cut into forwards of at most" in plan.describe()
    assert any("tokens per optimizer step" in line for line in said)
