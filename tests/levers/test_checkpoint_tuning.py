"""The tuner chooses how many layers checkpoint (checkpoint_layers="auto"), records k in the plan and re-applies it;
explicit settings are obeyed; bad requests fail at construction."""

import json
import logging
import shutil

import pytest
import torch

from hf_accum import AccumTrainingArguments
from hf_accum.compat import deepspeed_integration, gradient_checkpointing
from hf_accum.levers import checkpointing
from hf_accum.planning.store import PLAN_FILE
from hf_accum.probing.loop import NothingFitsError
from hf_accum.probing.plan import Plan
from hf_accum.tiny import build_model
from tests.conftest import sft_trainer
from tests.exactness import ExplicitArgsWrapper, tiny_llama

# One xdist worker runs these tests (--dist loadgroup): `auto_tuned` is built once, not on each.
pytestmark = pytest.mark.xdist_group("test_checkpoint_tuning")

MiB = 2**20
LAYERS = 4


def make(tmp_path, tok, model=None, **kw):
    # the checkpointing lever alone (the selective lever, which contains its levels, is tested in test_selective_lever)
    defaults = dict(output_dir=str(tmp_path), target_batch_size=16, memory_budget_bytes=9 * MiB, max_steps=2,
                    probe_seq_len=128, levers="selective=off")
    model = model if model is not None else build_model(tokenizer=tok, num_layers=LAYERS)
    return sft_trainer(tok, model, **{**defaults, **kw})


@pytest.fixture(scope="module")
def auto_tuned(tmp_path_factory, tok):
    """One tuned run with `make`'s settings (checkpoint_layers "auto"): the trainer, its plan, what the hf_accum
    loggers said at INFO during tune(), its output_dir and a copy of the plan file as tune() left it."""
    folder = tmp_path_factory.mktemp("auto")
    trainer = make(folder, tok)
    assert trainer.args.checkpoint_layers == "auto"
    said, logger = [], logging.getLogger("hf_accum")
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        plan = trainer.tune()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    stored = tmp_path_factory.mktemp("auto_stored") / PLAN_FILE
    shutil.copy(folder / PLAN_FILE, stored)
    return trainer, plan, "\n".join(said), folder, stored


def test_auto_measures_both_levels_chooses_verifies_and_applies_k(auto_tuned):
    trainer, plan, said, tmp_path, _ = auto_tuned
    result = trainer.probe_result
    levels = {t.checkpointed_layers for t in result.trials}
    assert levels >= {0, LAYERS}  # micro 1 does not fit 16 rows without checkpointing: both ends were measured
    assert plan.num_layers == LAYERS and 0 <= plan.checkpointed_layers <= LAYERS and plan.step_seconds > 0
    assert all(t.peak_bytes <= 9 * MiB for t in result.trials if t.fits)
    # the chosen point is covered by a step measured to fit at that level (or one with fewer layers checkpointed)
    chosen = result.extra["checkpointing"]["chosen"]
    assert any(t.fits and t.micro_batch_size >= chosen["micro"] and t.checkpointed_layers <= chosen["k"]
               for t in result.trials)
    assert gradient_checkpointing.checkpointed_count(trainer.model) == plan.checkpointed_layers
    assert f"checkpointing {plan.checkpointed_layers} of {LAYERS} layers" in said
    assert "s per optimizer step measured" in said
    stored = json.loads((tmp_path / PLAN_FILE).read_text())
    assert stored["plan"]["levers"]["checkpointing"]["layers"] == plan.checkpointed_layers
    assert stored["key"]["checkpoint_layers"] == "auto"
    assert len(result.measured_trials) <= 2 * 3 + 1  # at most twice today's trials (2-3 here) plus one verification
    trainer.train()
    assert trainer.state.global_step == 2


def test_a_stored_plans_k_is_reapplied_without_a_probe(tmp_path, tok, caplog, auto_tuned):
    path = tmp_path / PLAN_FILE
    shutil.copy(auto_tuned[4], path)  # what make(tmp_path, tok).tune() stores
    record = json.loads(path.read_text())
    record["plan"]["levers"]["checkpointing"]["layers"] = 3  # what a probe on another day chose
    path.write_text(json.dumps(record))
    again = make(tmp_path, tok)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        plan = again.tune()
    assert "stored plan (reused " in caplog.text and again.probe_result is None
    assert plan.checkpointed_layers == 3 and gradient_checkpointing.checkpointed_count(again.model) == 3
    assert [layer.gradient_checkpointing for layer in gradient_checkpointing.checkpointable_layers(again.model)] == [True] * 3 + [False]


def test_whole_window_fits_without_checkpointing_one_level_only(tmp_path, tok):
    trainer = make(tmp_path, tok, memory_budget_bytes=80 * MiB, target_batch_size=4)
    plan = trainer.tune()
    assert {t.checkpointed_layers for t in trainer.probe_result.trials} == {0}
    assert (plan.checkpointed_layers, plan.micro_batch_size) == (0, 4)
    assert gradient_checkpointing.checkpointed_count(trainer.model) == 0


@pytest.mark.parametrize("flag,count", [(False, 0), (True, LAYERS)])
def test_an_explicit_flag_is_obeyed(tmp_path, tok, flag, count):
    trainer = make(tmp_path, tok, gradient_checkpointing=flag)
    plan = trainer.tune()
    assert plan.checkpointed_layers is None
    assert {t.checkpointed_layers for t in trainer.probe_result.trials} == {None}
    assert gradient_checkpointing.checkpointed_count(trainer.model) == count


def test_an_explicit_k_is_probed_and_trained_at(tmp_path, tok):
    trainer = make(tmp_path, tok, checkpoint_layers=2)
    trainer.tune()
    assert gradient_checkpointing.checkpointed_count(trainer.model) == 2
    untuned = make(tmp_path / "off", tok, checkpoint_layers="1", auto_tune=False, per_device_train_batch_size=4,
                   gradient_accumulation_steps=4)
    untuned.train()
    assert gradient_checkpointing.checkpointed_count(untuned.model) == 1


def test_nothing_fits_even_with_every_layer_checkpointed(tmp_path, tok):
    trainer = make(tmp_path, tok, memory_budget_bytes=MiB // 4)
    with pytest.raises(NothingFitsError, match=f"every one of the {LAYERS} layers checkpointed") as info:
        trainer.tune()
    message = str(info.value)
    assert "LoRA" in message and "4-bit" in message and "shorten sequences" in message and "more ranks" in message
    assert "enable gradient checkpointing" not in message


def test_checkpointing_asked_of_a_model_that_cannot(tmp_path, tok):
    wrapped = ExplicitArgsWrapper(tiny_llama(torch.float32))
    with pytest.raises(ValueError, match="ExplicitArgsWrapper cannot checkpoint activations"):
        make(tmp_path, tok, model=wrapped, gradient_checkpointing=True)
    with pytest.raises(ValueError, match="checkpoint_layers=2, but ExplicitArgsWrapper"):
        make(tmp_path, tok, model=wrapped, checkpoint_layers=2)
    with pytest.raises(ValueError, match=f"checkpoint_layers=5, but LlamaForCausalLM has {LAYERS} checkpointable"):
        make(tmp_path, tok, checkpoint_layers=5)
    make(tmp_path, tok, model=ExplicitArgsWrapper(tiny_llama(torch.float32)))  # "auto": no error, no lever


def test_the_lever_is_skipped_under_a_sharded_engine(tmp_path, tok, monkeypatch, caplog):
    trainer = make(tmp_path, tok)
    monkeypatch.setattr(deepspeed_integration, "deepspeed_stage", lambda trainer: 3)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        assert checkpointing.lever_for(trainer) is None
    assert "not chosen by the probe under DeepSpeed" in caplog.text


def test_apply_plan_sets_k():
    model = tiny_llama(torch.float32, num_hidden_layers=3)
    args = AccumTrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    checkpointing.apply_chosen(model, 2, args)
    assert gradient_checkpointing.checkpointed_count(model) == 2
    plan = Plan(2, 4, 1, 8, levers={"checkpointing": {"layers": 2, "of": 3}}, step_seconds=0.5)
    assert plan.describe().endswith("; checkpointing 2 of 3 layers")
    assert Plan(2, 4, 1, 8).to_dict().keys() == {"micro_batch_size", "gradient_accumulation_steps", "world_size",
                                                 "target_batch_size"}
    with pytest.raises(ValueError, match=r"inconsistent plan: levers\['checkpointing'\]=\{'layers': 4, 'of': 3\}"):
        Plan(2, 4, 1, 8, levers={"checkpointing": {"layers": 4, "of": 3}})


def test_tokens_mode_measures_its_budget_at_the_chosen_level(tmp_path, tok):
    trainer = make(tmp_path, tok, micro_batching="tokens", probe_seq_len=None)
    plan = trainer.tune()
    assert plan.token_budget is not None and plan.num_layers == LAYERS and plan.checkpointed_layers is not None
    assert gradient_checkpointing.checkpointed_count(trainer.model) == plan.checkpointed_layers
    shorter = trainer.probe_result.extra["token_budget"]["short_trials"]
    assert shorter and all(t["checkpointed_layers"] is None for t in shorter)  # probed at k, no second choice
    assert "checkpointing" in trainer.probe_result.extra
