"""A non-finite window loss is never stepped: the step is skipped (gradients dropped, weights finite, a warning
naming it), training goes on; too many in a row stop with a checkpoint and a clear error; with two ranks, one
rank's NaN makes both skip."""

import logging
import math
import os

import pytest
import torch
from transformers.trainer_callback import PrinterCallback, TrainerCallback

from hf_accum import AccumTrainer, AccumTrainingArguments
from tests.exactness import lm_examples, pad_collate, sum_over_items_loss, tiny_gpt2
from tests.integrations.test_ddp import _torchrun

TORCHRUN = pytest.mark.xdist_group("torchrun")  # the multi-rank tests share one pytest-xdist worker: two
# two-rank runs at once on 2 cores were seen to hang. The file's one-process tests go to either worker.


class NaNAt:
    """Forward hook making the model's logits NaN at the given (1-based) training forward calls."""

    def __init__(self, model, calls):
        self.calls, self.count = set(calls), 0
        model.register_forward_hook(self)

    def __call__(self, module, args, output):
        if not module.training:
            return None
        self.count += 1
        if self.count in self.calls:
            output.logits = output.logits * float("nan")
        return output


def run(out, nan_calls, max_steps=6, **kw):
    model = tiny_gpt2()
    args = AccumTrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, target_batch_size=4,
        auto_tune=False, max_steps=max_steps, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        disable_tqdm=True, remove_unused_columns=False, logging_steps=1,
        **{"optim": "adamw_torch", "learning_rate": 1e-2, **kw},
    )
    trainer = AccumTrainer(model=model, args=args, train_dataset=lm_examples(48, seed=6), data_collator=pad_collate,
                           compute_loss_func=sum_over_items_loss)
    trainer.remove_callback(PrinterCallback)
    NaNAt(model, nan_calls)
    return trainer


def test_a_nan_step_is_skipped_and_training_goes_on(tmp_path, caplog):
    trainer = run(tmp_path, nan_calls=[5])  # forward 5 = the first micro-batch of step 3
    seen = {}

    def before(module, args):  # weights entering step 4's forwards: after the skipped step 3
        seen.setdefault("calls", 0)
        seen["calls"] += 1
        if seen["calls"] == 5:
            seen["at_nan"] = {n: p.detach().clone() for n, p in module.named_parameters()}
        if seen["calls"] == 7:
            seen["after_skip"] = {n: p.detach().clone() for n, p in module.named_parameters()}

    trainer.model.register_forward_pre_hook(before)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer.train()
    assert "optimizer step 3 are not finite; that step is skipped" in caplog.text
    assert trainer.state.global_step == 6  # the step counter (and the scheduler) advanced
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    # AdamW did not move on the skipped step: gradients were None, not zero
    assert all(torch.equal(seen["at_nan"][n], seen["after_skip"][n]) for n in seen["at_nan"])


def test_too_many_nan_steps_in_a_row_stop_with_a_checkpoint(tmp_path):
    trainer = run(tmp_path, nan_calls=range(5, 100), max_nonfinite_steps=2)
    with pytest.raises(RuntimeError, match=r"3 optimizer steps in a row had a non-finite loss.*max_nonfinite_steps=2"
                                           r".*stopped at step 5 with finite weights saved to .*checkpoint-5"):
        trainer.train()
    assert os.path.isdir(tmp_path / "checkpoint-5")
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@TORCHRUN
@pytest.mark.slow
def test_nan_on_one_rank_makes_both_skip(tmp_path):
    proc = _torchrun("nan_worker.py", tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout + proc.stderr
    assert out.count("optimizer step 3 are not finite") == 2  # rank 1's NaN: both ranks skip
    w0, w1 = (torch.load(tmp_path / f"final.rank{r}.pt") for r in (0, 1))
    assert all(torch.equal(w0[k], w1[k]) and not math.isnan(float(w0[k].sum())) for k in w0)


def test_under_deepspeed_the_default_is_off_with_one_line_and_only_an_explicit_limit_is_refused(tmp_path, monkeypatch,
                                                                                                   caplog):
    from hf_accum.integrations.engines import Engine

    monkeypatch.setattr(Engine, "steps_in_backward", True)  # the engine seam says: steps inside backward
    with caplog.at_level(logging.INFO, logger="hf_accum"):
        trainer = run(tmp_path, nan_calls=[5])  # max_nonfinite_steps left at its default
    # resolved on the trainer; its arguments keep what was given (transformers' test_training_arguments_are_left_untouched)
    assert trainer._nonfinite_limit is None and not trainer._skips_nonfinite
    assert trainer.args.max_nonfinite_steps == "auto"
    lines = [r for r in caplog.records if "max_nonfinite_steps" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "max_nonfinite_steps is off under DeepSpeed" in lines[0].getMessage()
    trainer.train()
    assert trainer.state.global_step == 6  # not skipped: transformers' behaviour
    with pytest.raises(ValueError, match=r"max_nonfinite_steps=3 is set, but DeepSpeed steps the optimizer inside "
                                         r"backward.*Leave max_nonfinite_steps unset \('auto'"):
        run(tmp_path, nan_calls=[], max_nonfinite_steps=3)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_accum"):
        run(tmp_path, nan_calls=[], max_nonfinite_steps=None)  # an explicit None: no line
    assert "max_nonfinite_steps" not in caplog.text


def test_the_default_elsewhere_is_three_and_the_callers_arguments_keep_auto(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hf_accum"):
        trainer = run(tmp_path, nan_calls=[])
    assert trainer._nonfinite_limit == 3 and trainer._skips_nonfinite
    assert trainer.args.max_nonfinite_steps == "auto"  # the trainer's copy of the arguments is left as given
    assert "more than 3 in a row stop training with a checkpoint (max_nonfinite_steps)" in caplog.text
    assert AccumTrainingArguments(output_dir=str(tmp_path), use_cpu=True).max_nonfinite_steps == "auto"


@pytest.mark.parametrize("given, engine_steps_in_backward, limit", [
    ("auto", False, 3), ("auto", True, None), (None, False, None), (None, True, None), (0, False, 0), (5, False, 5),
])
def test_resolve_nonfinite_limit(given, engine_steps_in_backward, limit):
    from hf_accum.config.arg_checks import resolve_nonfinite_limit

    got, line = resolve_nonfinite_limit(given, engine_steps_in_backward)
    assert got == limit and (line is not None) == (given == "auto")


@pytest.mark.parametrize("given", [0, 4])
def test_an_explicit_limit_under_deepspeed_is_refused(given):
    from hf_accum.config.arg_checks import resolve_nonfinite_limit

    with pytest.raises(ValueError, match=f"max_nonfinite_steps={given} is set, but DeepSpeed"):
        resolve_nonfinite_limit(given, True)


@pytest.mark.parametrize("flag, value", [("auto", "auto"), ("4", 4), ("0", 0), ("None", None)])
def test_max_nonfinite_steps_from_the_command_line(tmp_path, flag, value):
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(AccumTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--max_nonfinite_steps", flag])
    assert args.max_nonfinite_steps == value
    (default,) = HfArgumentParser(AccumTrainingArguments).parse_args_into_dataclasses(["--output_dir", str(tmp_path)])
    assert default.max_nonfinite_steps == "auto"


@pytest.mark.parametrize("value", [-1, "three", True, 2.5])
def test_a_bad_max_nonfinite_steps_is_refused(tmp_path, value):
    with pytest.raises(ValueError, match=r"max_nonfinite_steps=.* must be 'auto' \(the engine's default\)"):
        AccumTrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_nonfinite_steps=value)


@pytest.mark.parametrize("overrides, value", [([], "auto"), (["training.max_nonfinite_steps=4"], 4),
                                              (["training.max_nonfinite_steps=null"], None)])
def test_max_nonfinite_steps_from_a_recipe(overrides, value):
    from hf_accum.recipes.config import load_recipe

    assert load_recipe("lora_sft", overrides).training_args().max_nonfinite_steps == value


class InfGradAt:
    """Makes one weight's gradient infinite from the given (1-based) optimizer step on: the loss stays finite (as
    with fp16 weights and a large learning rate, whose backward overflows)."""

    def __init__(self, trainer, param, from_step):
        self.trainer, self.from_step = trainer, from_step
        param.register_hook(self)

    def __call__(self, grad):
        if self.trainer.state.global_step + 1 >= self.from_step:
            return grad * float("inf")
        return grad


def test_a_finite_loss_with_non_finite_gradients_is_skipped_and_the_stop_checkpoint_is_finite(tmp_path, caplog):
    from safetensors.torch import load_file

    trainer = run(tmp_path, nan_calls=[], max_nonfinite_steps=1, optim="sgd", learning_rate=0.1)
    trainer.model.half()  # fp16 weights, as TRL's test_train_model_dtype trains them
    InfGradAt(trainer, trainer.model.transformer.wte.weight, from_step=3)
    after_step_2 = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                after_step_2.update({n: p.detach().clone() for n, p in trainer.model.named_parameters()})

    trainer.add_callback(Snapshot())
    with caplog.at_level(logging.WARNING, logger="hf_accum"), pytest.raises(
            RuntimeError, match=r"2 optimizer steps in a row had a non-finite loss or gradients.*stopped at step 4 "
                                r"with finite weights saved to .*checkpoint-4"):
        trainer.train()
    assert "optimizer step 3 are not finite; that step is skipped" in caplog.text
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)  # the loss never was
    saved = load_file(tmp_path / "checkpoint-4" / "model.safetensors")
    assert saved and all(torch.isfinite(t).all() for t in saved.values())
    # steps 3 and 4 were skipped: the checkpoint holds the weights after step 2
    params = dict(trainer.model.named_parameters())
    assert all(torch.equal(params[n].detach(), after_step_2[n]) for n in after_step_2)
    assert all(torch.equal(saved[n], after_step_2[n]) for n in saved if n in after_step_2)


def test_weights_an_optimizer_made_non_finite_are_not_called_finite(tmp_path):
    # AdamW on fp16 weights: eps underflows to 0, so a step with finite gradients (grad norm ~1.7) makes NaN weights;
    # the steps after it are skipped (NaN loss), and the stop message must not claim finite weights
    trainer = run(tmp_path, nan_calls=[], max_nonfinite_steps=1)
    trainer.model.half()
    with pytest.raises(RuntimeError, match=r"stopped at step 3 with weights that are NOT finite \(an optimizer step"):
        trainer.train()
    assert not all(torch.isfinite(p).all() for p in trainer.model.parameters())
