"""Fails when transformers changes how `Trainer.training_step` post-processes the loss (see hf_accum/compat/trainer_internals.py)."""

import itertools
import os

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_accum.compat import (
    checkpoint_files,
    deepspeed_integration,
    gradient_checkpointing,
    parallel,
    process_group,
    torch_features,
    trainer_internals,
    trl_internals,
)
from hf_accum.planning.planner import set_train_batch_size
from tests.exactness import tiny_llama


@pytest.mark.parametrize(
    "accepts,num_items,loss_func,declared",
    [c for c in itertools.product([True, False], [None, 5], [None, "f"], [None, True, False])],
)
def test_training_step_division_rule(tmp_path, accepts, num_items, loss_func, declared):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, gradient_accumulation_steps=4)
    trainer = Trainer(model=tiny_llama(torch.float32), args=args)
    trainer.model_accepts_loss_kwargs = accepts
    trainer.compute_loss_func = (lambda *a, **k: None) if loss_func else None
    if declared is not None:  # set even on versions without the attribute: they must ignore it, and so must we
        trainer.loss_is_scaled_for_ga = declared
    trainer.current_gradient_accumulation_steps = 4
    weight = next(trainer.model.parameters())
    trainer.compute_loss = lambda model, inputs, **kw: (weight.sum() * 0 + 8.0)
    returned = float(trainer.training_step(trainer.model, {"input_ids": torch.ones(1, 2, dtype=torch.long)}, num_items))
    expected = 2.0 if trainer_internals.trainer_divides_by_accumulation(trainer, num_items) else 8.0
    assert returned == expected


# --- each internal in compat/, pinned: these fail when upstream renames or changes it ----------------------------
def test_trainer_internals_the_engine_reads(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=3)
    trainer = Trainer(model=tiny_llama(torch.float32), args=args)
    # the dataloader is built with the private batch size, which a plan applied after __init__ must set
    assert trainer._train_batch_size == 3
    set_train_batch_size(trainer, 5)
    from torch.utils.data import Dataset

    class Five(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"input_ids": [1, 2]}

    trainer.train_dataset = Five()
    assert trainer.get_train_dataloader().batch_size == 5 or trainer.get_train_dataloader().total_batch_size == 5
    # prepare_inputs moves a batch to the device, as the loop does
    batch = trainer_internals.prepare_inputs(trainer, {"input_ids": torch.ones(1, 2, dtype=torch.long)})
    assert batch["input_ids"].device.type == args.device.type
    # the window length: set outside the loop and restored
    with trainer_internals.window_length_set(trainer, 7):
        assert trainer_internals.window_length(trainer) == 7
    assert "current_gradient_accumulation_steps" not in trainer.__dict__


def test_trl_metrics_are_where_compat_restores_them(tmp_path):
    pytest.importorskip("trl")
    from trl import SFTConfig, SFTTrainer

    from hf_accum import tiny

    tok = tiny.build_tokenizer()
    args = SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, max_length=32)
    from datasets import Dataset

    data = Dataset.from_list([{"prompt": "1+1=", "completion": "2"}] * 4)
    trainer = SFTTrainer(model=tiny.build_model("causal_lm", tokenizer=tok), args=args, train_dataset=data,
                         processing_class=tok)
    assert isinstance(trainer._metrics, dict) and isinstance(trainer._total_train_tokens, int)
    with trl_internals.trl_metrics_untouched(trainer):
        trainer._metrics["train"]["entropy"].append(1.0)
        trainer._total_train_tokens += 5
    assert not trainer._metrics["train"]["entropy"] and trainer._total_train_tokens == 0


def test_kineto_memory_events_are_readable():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.ones(1024, 1024).sum()
    events = list(torch_features.kineto_events(prof))
    assert any(e.name() == "[memory]" and e.nbytes() > 0 for e in events)


def test_fsdp2_and_ddp_are_told_apart():
    from torch import nn

    model = nn.Linear(2, 2)
    assert not parallel.is_fsdp2(model) and parallel.unwrap_parallel(model) is model
    with parallel.no_gradient_sync(model):
        pass
    assert process_group.world_size() == 1

def test_the_class_fully_shard_swaps_in_is_told_from_the_model_class():
    """`fully_shard` swaps a module's class for `FSDP<Name>(FSDPModule, <Name>)` (torch's `_fsdp_init`); the
    probe's seed rebuilds the model from its config as the original class (`parallel.unsharded_class`)."""
    import inspect

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_init
    from transformers import LlamaForCausalLM

    assert '(wrapper_module_cls, cls), dct' in inspect.getsource(_fsdp_init)
    swapped = type("FSDPLlamaForCausalLM", (FSDPModule, LlamaForCausalLM), {})
    assert parallel.unsharded_class(swapped) is LlamaForCausalLM
    assert parallel.unsharded_class(LlamaForCausalLM) is LlamaForCausalLM
    assert parallel.fsdp2_shards(tiny_llama(torch.float32)) is None  # no DTensor: not sharded in place


def test_training_args_are_saved_before_trainer_state_and_read_without_unpickling_code(tmp_path, monkeypatch):
    # checkpoints.py knows a run's target from training_args.bin even when the plan file written after
    # trainer_state.json is lost: that needs transformers to write the arguments first.
    import os

    from transformers.trainer_callback import TrainerState

    from hf_accum.compat import (
        checkpoint_files,
    )
    from tests.trainer.test_checkpoints import trainer_for

    seen = []
    original = TrainerState.save_to_json

    def save_to_json(self, json_path):
        seen.append(checkpoint_files.saved_training_args(os.path.dirname(json_path)))
        return original(self, json_path)

    monkeypatch.setattr(TrainerState, "save_to_json", save_to_json)
    trainer_for(tmp_path / "run", micro=2, accum=2, stop=1).train()
    assert seen and seen[0]["target_batch_size"] == 4 and seen[0]["gradient_accumulation_steps"] == 2
    assert checkpoint_files.saved_training_args(str(tmp_path / "absent")) is None


def test_attn_implementation_is_read_from_the_config():
    from hf_accum.compat import (
        torch_features,
    )
    from hf_accum.tiny import build_model

    model = build_model()
    assert torch_features.attn_implementation(model) == "sdpa"
    model.set_attn_implementation("eager")
    assert torch_features.attn_implementation(model) == "eager"

# --- what hf_accum/levers/kernels/fused_loss.py relies on ------------------------------------------------------------------------
def test_torch_chunked_linear_cross_entropy_contract():
    """torch >= 2.13: F.linear_cross_entropy(options=...) is the sum of token CE with -100 ignored, and its gradients
    (computed in the forward) follow a scaled upstream gradient, as hf_accum's window scaling applies one."""
    from packaging.version import Version

    import hf_accum.levers.kernels.fused_loss as fl

    torch.manual_seed(0)
    h, w, b = torch.randn(20, 8, dtype=torch.float64), torch.randn(50, 8, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    y = torch.randint(0, 50, (20,))
    y[::4] = -100
    if Version(torch.__version__.split("+")[0]) >= Version("2.13"):
        assert torch_features.HAS_LINEAR_CROSS_ENTROPY
    if not torch_features.HAS_LINEAR_CROSS_ENTROPY:  # older torch: the fused loss must use its own chunks
        assert fl.implementation_for(h, w) == "chunked"
        return
    assert fl.implementation_for(h, w) == "torch"
    got = [t.clone().requires_grad_() for t in (h, w, b)]
    want = [t.clone().requires_grad_() for t in (h, w, b)]
    loss = torch_features.linear_cross_entropy_sum(*got, y, rows=3)
    (loss * 0.37).backward()
    ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(*want), y, reduction="sum")
    (ref * 0.37).backward()
    assert torch.allclose(loss, ref, rtol=1e-12)
    for g, r in zip(got, want):
        assert torch.allclose(g.grad, r.grad, rtol=1e-10, atol=1e-12)
    with pytest.raises(UserWarning, match="options"):  # torch declining the chunked path is an error, not full logits
        torch_features.linear_cross_entropy_sum(h, w, b, y.int(), rows=3)


def test_transformers_causal_lm_forward_contract():
    """The fused loss stubs the LM head: it relies on the causal LM calling it once on the hidden states and returning
    its output as the logits, with ForCausalLMLoss's shift / shift_labels / num_items_in_batch semantics."""
    import inspect

    from transformers.loss.loss_utils import ForCausalLMLoss

    import hf_accum.levers.kernels.fused_loss as fl
    from tests.exactness import tiny_gpt2

    assert {"shift_labels", "num_items_in_batch", "ignore_index"} <= set(inspect.signature(ForCausalLMLoss).parameters)
    for model in (tiny_llama(torch.float64), tiny_gpt2()):
        assert fl.unsupported_reason(model) is None
        ids = torch.tensor([[3, 4, 5, 6, 7]])
        labels = torch.tensor([[-100, 4, 5, -100, 7]])
        model.train()
        plain = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(5))
        with fl.fused_lm_loss(model):
            fused = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(5))
            pre = model(input_ids=ids, labels=ids, shift_labels=torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100),
                        num_items_in_batch=torch.tensor(5))
        assert fused.logits is None and plain.logits is not None
        assert float(fused.loss) == pytest.approx(float(plain.loss), rel=1e-6)
        assert float(pre.loss) == pytest.approx(float(plain.loss), rel=1e-6)


def test_trl_preference_collator_cut_contract():
    """`preference_collator_cut` reads DPO's collator's ``max_length``, which cuts prompt + completion rows to it."""
    pytest.importorskip("trl")
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    from trl.trainer.reward_trainer import DataCollatorForPreference as RewardCollator

    collate = DataCollatorForPreference(pad_token_id=0, max_length=4)
    assert trl_internals.preference_collator_cut(collate) == 4
    assert collate([{"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]}])["input_ids"].shape == (2, 4)
    assert trl_internals.preference_collator_cut(DataCollatorForPreference(pad_token_id=0)) is None
    assert trl_internals.preference_collator_cut(RewardCollator(pad_token_id=0)) is None  # RewardTrainer cuts nothing


def test_trl_fused_lm_head_contract():
    """AccumSFTTrainer leaves fusing to TRL: its fused head's loss must be the model's own (sum over num_items)."""
    pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    assert trl_internals.trl_fuses_lm_head()
    model = tiny_llama(torch.float64)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    labels = torch.tensor([[-100, 4, 5, -100, 7]])
    plain = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(5))
    add_fused_lm_head(model)
    fused = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(5), fused_lm_head=True)
    assert float(fused.loss) == pytest.approx(float(plain.loss), rel=1e-6)


def test_trls_fused_head_is_read_off_the_model():
    """`trl_internals.fused_lm_head_outputs`: TRL keeps no marker of its head, only the closure it patches in."""
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_llama(torch.float32)
    assert trl_internals.fused_lm_head_outputs(model) is None
    add_fused_lm_head(model, outputs=("log_probs", "is_top1"))
    assert trl_internals.fused_lm_head_outputs(model) == ("log_probs", "is_top1")


def test_the_loop_counts_tokens_and_flops_per_loaded_batch_through_overridable_methods():
    # AccumulationMixin overrides both to count the tokens its forwards held (see add_input_tokens_seen)
    import inspect

    loop = inspect.getsource(Trainer._inner_training_loop) + inspect.getsource(Trainer)
    assert "self._track_num_input_tokens(inputs)" in loop
    assert "self.floating_point_ops(inputs)" in loop
    track = inspect.getsource(Trainer._track_num_input_tokens)
    assert "self.state.num_input_tokens_seen += self.accelerator.gather(input_tokens).sum().item()" in track


def test_load_time_sharding_is_read_from_the_model_and_transformers_still_cannot_resume_it():
    import inspect

    from transformers import PreTrainedModel

    assert parallel.sharded_at_load(tiny_llama(torch.float32)) is False
    if not hasattr(PreTrainedModel, "is_distributed_loading_by_transformers"):
        return  # transformers 5.17: no load-time sharding (tests/integrations/test_fsdp2.py is skipped there)
    assert isinstance(inspect.getattr_static(PreTrainedModel, "is_distributed_loading_by_transformers"), property)
    # hf_accum refuses resume_from_checkpoint for such models because transformers checkpoints no optimizer state
    # for them; when this refusal goes, resuming may have become possible: revisit stopping.refuse_unresumable
    assert "Resuming is not supported for models sharded at load time" in inspect.getsource(Trainer.__init__)


def test_the_default_process_groups_store_is_reachable(tmp_path):
    import torch.distributed as dist

    assert process_group.default_store() is None  # no process group
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        store = process_group.default_store()
        assert not store.check(["hf_accum/test"])
        store.set("hf_accum/test", "why")
        assert store.check(["hf_accum/test"]) and store.get("hf_accum/test") == b"why"
    finally:
        dist.destroy_process_group()


def test_deepspeed_user_config_keeps_auto_and_never_writes(tmp_path):
    """The DeepSpeed pieces that need an engine (`fill_deepspeed_config`, `engine_label`, `engine_boundary` through
    accelerate's backward) are pinned on a real one in tests/integrations/test_deepspeed.py::test_one_process_pieces_and_oom_stop;
    this is the parse every batch-field check starts from."""
    import json

    given = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}
    parsed = deepspeed_integration.deepspeed_user_config(given)
    assert parsed == given and parsed is not given
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(given))
    assert deepspeed_integration.deepspeed_user_config(str(path)) == given


# --- optimizer state in a checkpoint (checkpoints.py refuses resuming a checkpoint without it) ---------------------
def _plain_run(out, **kw):
    from tests.exactness import lm_examples, pad_collate, tiny_gpt2

    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, learning_rate=1e-2, report_to=[],
                             use_cpu=True, seed=0, disable_tqdm=True, remove_unused_columns=False, save_steps=2,
                             save_only_model=True, **kw)
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=lm_examples(16, seed=6), data_collator=pad_collate)


def test_transformers_still_resumes_a_save_only_model_checkpoint_with_a_fresh_optimizer(tmp_path):
    # Why hf_accum refuses such a checkpoint: transformers loads the optimizer and scheduler only when their files
    # exist, else goes on from step 2 with AdamW's moments and the schedule at zero, without a word (5.17 to 5.23).
    # When this fails, transformers refuses or warns by itself: revisit checkpoints._optimizer_problem.
    _plain_run(tmp_path, max_steps=2).train()
    ckpt = tmp_path / "checkpoint-2"
    assert checkpoint_files.optimizer_state_kinds(str(ckpt)) == frozenset()
    resumed = _plain_run(tmp_path, max_steps=3)
    resumed.train(resume_from_checkpoint=str(ckpt))
    weight = next(resumed.model.parameters())
    assert resumed.state.global_step == 3
    assert int(resumed.optimizer.state[weight]["step"]) == 1 and resumed.lr_scheduler.last_epoch == 1


@pytest.mark.parametrize("files,loads", [
    (("optimizer.pt", "scheduler.pt"), True),
    (("optimizer.bin", "scheduler.pt"), True),  # accelerate's FSDP, full state dict
    (("optimizer_0/", "scheduler.pt"), True),  # accelerate's FSDP, sharded state dict
    (("optimizer.pt",), False),
    (("optimizer.bin",), False),
    (("scheduler.pt",), False),
    (("model.safetensors", "trainer_state.json", "rng_state.pth"), False),
    (("global_step2/", "scheduler.pt"), False),  # DeepSpeed's: not for a run without DeepSpeed
])
def test_optimizer_state_kinds_is_what_the_trainer_loads(tmp_path, monkeypatch, files, loads):
    trainer = Trainer(model=tiny_llama(torch.float32),
                      args=TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True))
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    for name in files:
        (ckpt / name.rstrip("/")).mkdir() if name.endswith("/") else (ckpt / name).write_bytes(b"")
    loaded = []
    monkeypatch.setattr(torch, "load", lambda path, *a, **k: loaded.append(os.path.basename(path)) or {})
    monkeypatch.setattr(trainer.optimizer, "load_state_dict", lambda state: loaded.append("optimizer"))
    monkeypatch.setattr(trainer.lr_scheduler, "load_state_dict", lambda state: loaded.append("scheduler"))
    trainer._load_optimizer_and_scheduler(str(ckpt))
    assert bool(loaded) is loads and (not loads or {"optimizer", "scheduler"} <= set(loaded))
    assert ("trainer" in checkpoint_files.optimizer_state_kinds(str(ckpt))) is loads
    assert ("deepspeed" in checkpoint_files.optimizer_state_kinds(str(ckpt))) is ("global_step2/" in files)


@pytest.mark.parametrize("deepspeed_folder", [True, False])
def test_deepspeed_resumes_from_a_global_step_folder_only(tmp_path, deepspeed_folder):
    from transformers.integrations.deepspeed import deepspeed_load_checkpoint

    class Engine:
        def load_checkpoint(self, path, **kwargs):
            self.loaded = (path, kwargs["load_optimizer_states"], kwargs["load_lr_scheduler_states"])
            return path, {}

    if deepspeed_folder:
        (tmp_path / "global_step2").mkdir()
    engine = Engine()
    assert ("deepspeed" in checkpoint_files.optimizer_state_kinds(str(tmp_path))) is deepspeed_folder
    if deepspeed_folder:
        deepspeed_load_checkpoint(engine, str(tmp_path))
        assert engine.loaded == (str(tmp_path), True, True)  # optimizer and schedule come from the engine's folder
    else:
        with pytest.raises(ValueError, match="Can't find a valid checkpoint"):
            deepspeed_load_checkpoint(engine, str(tmp_path))


def test_the_trainer_says_whether_deepspeed_loads_its_checkpoints(tmp_path):
    trainer = Trainer(model=tiny_llama(torch.float32),
                      args=TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True))
    assert trainer.is_deepspeed_enabled is False and deepspeed_integration.deepspeed_enabled(trainer) is False
    trainer.is_deepspeed_enabled = True
    assert deepspeed_integration.deepspeed_enabled(trainer) is True


def test_deepspeed_bucket_fields_and_their_defaults():
    """`deepspeed_integration.deepspeed_buckets` reads these from the live engine's `_config.zero_config` (that attribute is pinned on a
    real engine in tests/integrations/test_deepspeed.py::test_deepspeed_with_default_arguments); the "nothing fits" advice names
    the config keys."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = DeepSpeedZeroConfig(stage=2)
    assert (zero.reduce_bucket_size, zero.allgather_bucket_size) == (5 * 10**8, 5 * 10**8)
    assert DeepSpeedZeroConfig(stage=3, stage3_prefetch_bucket_size=123).prefetch_bucket_size == 123
    assert DeepSpeedZeroConfig(stage=2, reduce_bucket_size=7, allgather_bucket_size=9).allgather_bucket_size == 9


# --- evaluation (hf_accum/window/evaluation.py) ----------------------------------------------------------------------
def test_prediction_step_computes_its_loss_through_compute_loss_with_num_items(tmp_path):
    given = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        given.append(num_items_in_batch)
        return outputs.logits.float().sum() * 0 + 3.0

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = Trainer(model=tiny_llama(torch.float32), args=args, compute_loss_func=loss_func)
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.ones(2, 3, dtype=torch.long)}
    with trainer_internals.prediction_loss_counted(trainer, torch.tensor(7)) as seen:
        loss, logits, labels = trainer.prediction_step(trainer.model, batch, prediction_loss_only=False)
        trainer.compute_loss(trainer.model, batch, return_outputs=False)  # TRL's prediction_step passes no count
    assert given == [torch.tensor(7)] * 2 and len(seen) == 2 and float(seen[0]) == float(loss) == 3.0
    assert logits.shape == (2, 3, trainer.model.config.vocab_size) and labels.shape == (2, 3)
    assert "compute_loss" not in trainer.__dict__  # the class's own method again


def test_gather_for_metrics_keeps_the_first_remainder_rows_of_the_last_batch(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_eval_batch_size=4)
    trainer = Trainer(model=tiny_llama(torch.float32), args=args)
    data = [{"input_ids": [i + 1, 2]} for i in range(10)]
    loader = trainer.get_eval_dataloader(data)
    accelerator = trainer.accelerator
    accelerator.gather = lambda t: torch.cat([t, t + 100])  # as if a second rank had sent rows of its own
    seen = []
    for batch in loader:
        state = accelerator.gradient_state
        rows = batch["input_ids"][:, 0]
        seen.append((state.end_of_dataloader, state.remainder, accelerator.gather_for_metrics(rows).tolist()))
        assert trainer_internals.eval_rows_kept(trainer, len(rows)) == (len(rows), None)  # one process: every row counts
    assert [s[0] for s in seen] == [False, False, True] and seen[-1][1] == 10 % 4
    assert seen[-1][2] == [9, 10]  # the first `remainder` gathered rows: this rank's, not the other's


def test_per_layer_checkpointing_flag():
    """transformers checkpoints a `GradientCheckpointingLayer` exactly when its instance flag `gradient_checkpointing`
    is True (in training), through the `_gradient_checkpointing_func` its enable sets: `gradient_checkpointing.set_checkpointed_layers`
    relies on both."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model = tiny_llama(torch.float32, num_hidden_layers=3)
    layers = gradient_checkpointing.checkpointable_layers(model)
    assert len(layers) == 3 and all(isinstance(m, GradientCheckpointingLayer) for m in layers)
    assert list(model.model.layers) == layers  # forward order: "the first k" are the first k to run
    assert GradientCheckpointingLayer.gradient_checkpointing is False and gradient_checkpointing.checkpointed_count(model) == 0
    gradient_checkpointing.set_checkpointed_layers(model, 2, {"use_reentrant": False})
    assert [m.gradient_checkpointing for m in layers] == [True, True, False]
    calls = []
    for i, layer in enumerate(layers):
        func = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda f, *a, _i=i, _func=func, **k: (calls.append(_i), _func(f, *a, **k))[1]
    model.train()
    model(input_ids=torch.ones(1, 4, dtype=torch.long)).logits.sum().backward()
    assert calls == [0, 1]  # the unflagged layer ran as is
    model.eval()
    calls.clear()
    model(input_ids=torch.ones(1, 4, dtype=torch.long))
    assert calls == []  # evaluation never checkpoints
    gradient_checkpointing.set_checkpointed_layers(model, 0)
    assert gradient_checkpointing.checkpointed_count(model) == 0
    # the enable method hf_accum calls, by name on the versions it supports
    assert hasattr(model, "activation_checkpointing_enable") or hasattr(model, "gradient_checkpointing_enable")


def test_checkpointing_argument_unset_is_none():
    """`AccumTrainingArguments` must tell an unset checkpointing flag from an explicit False (args.py): transformers
    5.24's `activation_checkpointing` defaults to None; 5.17 had only `gradient_checkpointing: bool = False`, which
    hf_accum overrides to None."""
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    if "activation_checkpointing" in fields:
        assert fields["activation_checkpointing"].default is None
    assert "gradient_checkpointing" in fields and "gradient_checkpointing_kwargs" in fields


def test_the_console_callbacks_can_be_left_out_of_one_log_call(tmp_path, capsys):
    """`trainer_internals.printers_without`: `Trainer.log` reaches every callback through `callback_handler.callbacks`;
    with the console ones handed the entry without some keys for that call, those keys are recorded (log_history,
    other callbacks) and not printed, and the rest of the entry is printed as transformers prints it."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    seen = []

    class Listener(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=tiny_llama(torch.float32), args=args, callbacks=[Listener()])
    assert any(isinstance(c, PrinterCallback | ProgressCallback) for c in trainer.callback_handler.callbacks)
    before = list(trainer.callback_handler.callbacks)
    with trainer_internals.printers_without(trainer, {"hf_accum/figure"}):
        trainer.log({"hf_accum/figure": 1.0, "loss": 2.5, "total_flos": 7.0})
    assert trainer.callback_handler.callbacks == before  # restored
    assert seen and seen[-1]["hf_accum/figure"] == 1.0 and trainer.state.log_history[-1]["hf_accum/figure"] == 1.0
    printed = capsys.readouterr().out
    assert "hf_accum/figure" not in printed and "'loss'" in printed and "2.5" in printed and "total_flos" not in printed
    trainer.log({"hf_accum/other": 2.0})  # without the context the printer prints, as transformers does
    assert "hf_accum/other" in capsys.readouterr().out


def test_the_loop_ends_each_step_and_saves_through_the_methods_the_trainer_overrides():
    """`AccumulationMixin._maybe_log_save_evaluate` acts on each optimizer step after the callbacks' on_step_end and
    before the Trainer logs and saves; `_save_checkpoint` writes the checkpoint that on_save follows."""
    import inspect

    loop = inspect.getsource(Trainer._run_epoch)  # one epoch of the loop (transformers 5.17 to 5.24)
    step_end = loop.index("callback_handler.on_step_end(")
    assert loop.index("self._maybe_log_save_evaluate(", step_end) > step_end
    saving = inspect.getsource(Trainer._maybe_log_save_evaluate)
    assert "self._save_checkpoint(model, trial)" in saving
    assert saving.index("self._save_checkpoint(") < saving.index("callback_handler.on_save(")
    assert saving.index("self.log(") < saving.index("self._save_checkpoint(")


@pytest.mark.parametrize("keep", [None, 4, 20, -1, -200])
def test_a_file_flagged_unreadable_is_one_its_loader_refuses(tmp_path, keep):
    """`checkpoint_files.unreadable_file` flags exactly the cut-short safetensors files and torch archives that
    safetensors' and torch's own loaders refuse, and passes the intact ones (keep=None)."""
    from safetensors.torch import load_file, save_file

    save_file({"w": torch.arange(64.0).reshape(8, 8), "b": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    torch.save({"state": {0: {"exp_avg": torch.zeros(40)}}, "param_groups": []}, str(tmp_path / "optimizer.pt"))
    for name in ("model.safetensors", "optimizer.pt"):
        path = tmp_path / name
        data = path.read_bytes()
        if keep is not None:
            path.write_bytes(data[:keep])
    broken = checkpoint_files.unreadable_file(str(tmp_path))
    refused = []
    for name, load in (("model.safetensors", load_file), ("optimizer.pt", torch.load)):
        try:
            load(str(tmp_path / name))
        except Exception:
            refused.append(name)
    if keep is None:
        assert broken is None and refused == []
    else:  # both refused by their loaders; the first one (by name) is named
        assert refused == ["model.safetensors", "optimizer.pt"] and broken.startswith("model.safetensors: ")
        (tmp_path / "model.safetensors").unlink()
        assert checkpoint_files.unreadable_file(str(tmp_path)).startswith("optimizer.pt: ")


def test_peft_still_reads_the_renamed_checkpointing_property_and_our_wraps_say_nothing_of_it(tmp_path):
    """Issue 42 item 17: `hf-accum probe --lora`, the recipes and `--estimate --lora` printed transformers'
    FutureWarning for peft's read of `is_gradient_checkpointing`. peft still reads it (the filter's reason; when
    this fails, drop `peft_reads_quietly`), and our LoRA wraps print no deprecation."""
    import warnings

    from peft import LoraConfig, get_peft_model

    from hf_accum import estimate
    from hf_accum.probing.loading import add_lora
    from tests.exactness import tiny_llama

    def deprecations(fn):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fn()
        return [str(w.message) for w in seen if issubclass(w.category, FutureWarning) and "deprecated" in str(w.message)]

    model = tiny_llama()
    if not hasattr(model, "is_activation_checkpointing"):  # pragma: no cover - transformers < 5.23: no rename yet
        pytest.skip("this transformers has no activation_checkpointing rename")
    lora = LoraConfig(r=4, target_modules=["q_proj"])
    assert any("is_gradient_checkpointing" in m for m in deprecations(lambda: get_peft_model(tiny_llama(), lora)))
    assert deprecations(lambda: add_lora(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj"]))) == []
    tiny_llama().config.save_pretrained(tmp_path)
    assert deprecations(lambda: estimate(str(tmp_path), lora_r=4, device="cpu", seq_len=16, target_batch_size=2)) == []


def test_grpo_generates_into_its_buffer_when_it_is_empty():
    """`trl_internals.grpo_generated_slices` empties GRPOTrainer's `_buffered_inputs` so that `_prepare_inputs`
    generates a whole generation batch, and takes its `steps_per_generation` slices from there; its compute_loss
    reads the window's count from the batch's num_items_in_batch and divides by current_gradient_accumulation_steps
    (grpo.GRPOAdapter.chunk sets both)."""
    pytest.importorskip("trl")
    import inspect

    from trl import GRPOTrainer

    prepare = inspect.getsource(GRPOTrainer._prepare_inputs)
    assert "or self._buffered_inputs is None" in prepare
    assert "self._buffered_inputs = [" in prepare and "split_tensor_dict(generation_batch, self.args.steps_per_generation)" in prepare
    # num_iterations: one generation every steps_per_generation x num_iterations micro-steps, the buffer reused
    # between (trl_internals.grpo_reused_slices); the generating policy's log-probs kept for the later steps
    assert "generate_every = self.args.steps_per_generation * self.num_iterations" in prepare
    generated = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "if self.args.gradient_accumulation_steps % generate_every != 0" in generated
    assert 'output["old_per_token_logps"] = old_per_token_logps' in generated
    loss = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes' in loss
    assert "normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation" in loss
    assert loss.count("normalizer = self.current_gradient_accumulation_steps if mode == \"train\" else 1.0") >= 3
    # the static entropy bonus: entropy_coef read per forward, over the forward's token mean of the loss mask, and
    # logged as a metric (trl_internals.grpo_entropy_coef_scaled)
    assert "if self._entropy_bonus_enabled:" in loss and "apply_coef = self.entropy_coef" in loss
    assert "(entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation_factor" in loss
    assert 'self._metrics[mode]["entropy_coef"].append(self.entropy_coef)' in loss
    # the entropy filter: its mask from the method hf_accum replaces per forward (trl_internals.grpo_entropy_mask_fixed)
    assert "entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)" in loss
    params = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters
    assert list(params)[1:5] == ["model", "input_ids", "attention_mask", "logits_to_keep"]
    assert "batch_size" in params and "compute_entropy" in params


def test_transformers_writes_a_models_files_on_global_rank_0_only_and_node_saving_defers_to_the_trainer(monkeypatch):
    """Pins `compat.node_saving`: transformers' `should_save_on_this_rank` ignores the Trainer's choice on a rank
    other than 0 (save_on_each_node's node-local rank 0). If this fails, upstream honours it: drop the patch."""
    from transformers.distributed import mixin

    from hf_accum.compat import node_saving
    from tests.exactness import tiny_gpt2

    model = tiny_gpt2()
    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 2)  # node 1's local rank 0
    assert model.should_save_on_this_rank(True) is False  # upstream: global rank 0 only
    with node_saving.each_node(model, save_on_each_node=True):
        assert model.should_save_on_this_rank(True) is True and model.should_save_on_this_rank(False) is False
    assert model.should_save_on_this_rank(True) is False  # undone
    with node_saving.each_node(model, save_on_each_node=False):  # the Trainer's default: transformers as it is
        assert model.should_save_on_this_rank(True) is False
