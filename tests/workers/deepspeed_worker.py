"""Run under `torchrun --nproc_per_node 2` (gloo, CPU, `use_cpu=True`): AccumTrainer under DeepSpeed ZeRO. Modes:
- train OUT: the same data and target (8: micro 2 × accumulation 2 × world 2) under DDP, ZeRO-2 and ZeRO-3 ("auto"
  batch fields), and ZeRO-2 with micro_batching="tokens" (each rank's window loaded whole and cut into several
  forwards by a token budget: the engine must step once per window, not per forward); then ZeRO-3 stopped after a
  checkpoint at step 2 and resumed from it in a new trainer; and ZeRO-2 / ZeRO-3 with auto_tune (the probe runs
  through the engine at the first window), recording the weights when the first optimizer step begins, the
  probe's trials and one real step measured after training. Saves per rank the final full weights, the engine's
  batch fields and step count, the plan and the forwards run.
Every ZeRO-3 run trains the model in float32 (DeepSpeed's ZeRO-3 shards no float64 parameters: hf_accum refuses a
float64 model under it, `compat.deepspeed_integration.refuse_zero3_float64`, which the oom mode records); DDP and
ZeRO-2 train it in float64. The float32 model is the float64 one's initial weights exactly (built in float32, cast).
Modes joined by commas ("single,defaults") run in turn in one launch.
- single OUT (one process, no launcher; world 1): the `compat.deepspeed_integration` pieces on a real DeepSpeed setup (the plan filled
  into the config accelerate builds the engine from, a contradicting explicit field refused when a plan is applied,
  accelerate's backward stepping the engine only when `engine_boundary` says final, the shm op skipped), and an
  out-of-memory error under DeepSpeed stopping a one-process run too (its engine's gradients cannot be cleared).
- defaults OUT (one process): ZeRO-2 with default arguments (see `defaults_mode`).
- probe_oom OUT: auto_tune under ZeRO-3 with an out-of-memory error in rank 1's first probe trial: every rank stops.
- oom OUT: use_cpu=False on CPU (each rank would see world 1) must be refused (message written per rank); then
  ZeRO-3 with an out-of-memory error injected in rank 1's third forward: every rank must stop, none hang.
"""

import json
import os
import sys

import torch
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def skip_shm_comm_op():
    """DeepSpeed's CPU accelerator JIT-compiles its shared-memory all-reduce op (`deepspeed_shm_comm`, 30-100 s, in
    ~/.cache/torch_extensions) when its comm backend starts; that op serves only `inference_all_reduce` (tensor-
    parallel inference), never training's collectives, which go through torch.distributed (gloo). Marking it
    incompatible, where DeepSpeed's own check reads it, skips the compile (pinned in tests/integrations/test_deepspeed.py)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def ds_config(stage: int, **zero) -> dict:
    return {"zero_optimization": {"stage": stage, **zero}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}


class CountForwards:
    def __init__(self, model):
        self.count = 0
        model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        if module.training:
            self.count += 1


def trainer_for(out, stage=None, max_steps=3, save_steps=None, callbacks=(), micro=2, accumulation=2, tuned=False,
                zero=None, dtype=None, **kw):
    """``dtype``: the model's (default float64, float32 under ZeRO-3: see the module docstring)."""
    from accelerate.state import AcceleratorState
    from transformers.trainer_callback import PrinterCallback

    from hf_accum import AccumTrainer, AccumTrainingArguments
    from tests.exactness import lm_examples, pad_collate, tiny_gpt2

    # accelerate's state is a process-wide singleton holding the first DeepSpeed plugin: clear it between runs of
    # one process (as transformers' hyperparameter search does), keeping the process group
    AcceleratorState._reset_state()
    args = AccumTrainingArguments(
        output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        target_batch_size=micro * accumulation * int(os.environ["WORLD_SIZE"]),
        auto_tune=tuned, max_steps=max_steps, learning_rate=1e-2, max_grad_norm=0.0, report_to=[],
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, use_cpu=True, seed=0,
        disable_tqdm=True, remove_unused_columns=False, ddp_backend="gloo", logging_steps=1,
        deepspeed=ds_config(stage, **(zero or {})) if stage is not None else None, **kw,  # max_nonfinite_steps: default
    )
    dtype = dtype or (torch.float32 if stage == 3 else torch.float64)
    trainer = AccumTrainer(model=tiny_gpt2(dtype), args=args, train_dataset=lm_examples(40, seed=3),
                           data_collator=pad_collate, callbacks=list(callbacks))
    trainer.remove_callback(PrinterCallback)
    return trainer


def full_weights(trainer) -> dict:
    params = list(trainer.model.named_parameters())
    if getattr(trainer, "deepspeed", None) is not None and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().clone() for n, p in params}
    return {n.removeprefix("module."): p.detach().clone() for n, p in params}


def engine_record(trainer) -> dict:
    engine = trainer.deepspeed
    return {"stage": engine.zero_optimization_stage(), "micro": engine.train_micro_batch_size_per_gpu(), "accumulation": engine.gradient_accumulation_steps(),
            "train_batch": engine.train_batch_size(), "engine_steps": engine.global_steps,
            "steps": trainer.state.global_step, "plan": trainer.plan.to_dict() if trainer.plan else None,
            "describe": trainer.plan.describe() if trainer.plan else None,
            "config": [trainer.accelerator.state.deepspeed_plugin.deepspeed_config[k] for k in
                       ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")]}


class AfterProbe(TrainerCallback):
    """What the engine holds when the first optimizer step begins, after the probe ran through it."""

    def __init__(self):
        self.trainer, self.record = None, None

    def on_step_begin(self, args, state, control, **kwargs):
        from hf_accum.probing.engine import SCRATCH

        if self.record is None:
            self.record = {"weights": full_weights(self.trainer), "engine_steps": self.trainer.deepspeed.global_steps,
                           "scratch_left": os.path.exists(os.path.join(args.output_dir, SCRATCH))}


def real_step_peak(trainer):
    """The CPU meter around one real optimizer step at the plan, through the window engine and DeepSpeed's engine
    (after training: the weights recorded before it are not affected; the baseline then also holds those records)."""
    from hf_accum.probing.meters import CpuMeter, all_live_tensor_bytes

    batch = next(iter(trainer.get_train_dataloader()))
    # a whole window, which the window engine cuts into the plan's forwards
    assert batch["input_ids"].shape[0] == trainer.plan.window and trainer._engine.cut_units == trainer.plan.micro_batch_size
    meter = CpuMeter(resident=all_live_tensor_bytes)
    m = meter.measure(lambda: trainer.training_step(trainer.deepspeed, batch))
    return {"peak_bytes": m.peak_bytes, "baseline_bytes": m.baseline_bytes}


def train_mode(out, rank):
    from tests.exactness import tiny_gpt2
    from tests.trainer.test_resume import StopAt

    result = {"initial": {n: p.detach().clone() for n, p in tiny_gpt2().named_parameters()}}
    runs = {"ddp": {}, "zero2": {"stage": 2}, "zero3": {"stage": 3},
            "zero2_tokens": {"stage": 2, "micro_batching": "tokens", "max_tokens_per_forward": 40}}
    for name, kw in runs.items():
        trainer = trainer_for(os.path.join(out, name), **kw)
        forwards = CountForwards(trainer.model)
        trainer.train()
        result[name] = full_weights(trainer)
        result[f"{name}_forwards"] = forwards.count
        if name != "ddp":
            result[f"{name}_engine"] = engine_record(trainer)
    # auto_tune: the probe runs through the engine at the first window (capped at micro 2: the plan is DDP's)
    for name, stage in (("zero2_tuned", 2), ("zero3_tuned", 3)):
        after = AfterProbe()
        trainer = trainer_for(os.path.join(out, name), stage=stage, tuned=True, probe_max_micro_batch=2,
                              callbacks=[after])
        after.trainer = trainer
        forwards = CountForwards(trainer.model)
        trainer.train()
        result[name] = full_weights(trainer)
        result[f"{name}_forwards"] = forwards.count
        result[f"{name}_engine"] = engine_record(trainer)
        result[f"{name}_after_probe"] = after.record
        result[f"{name}_trials"] = [t.__dict__ for t in trainer.probe_result.trials]
        result[f"{name}_args"] = [trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps]
        with open(os.path.join(out, name, "hf_accum_plan.json")) as f:
            result[f"{name}_stored"] = json.load(f)["plan"]
        result[f"{name}_real_peak"] = real_step_peak(trainer)
    # auto_tune with micro_batching="tokens": the token budget measured through the engine (3 lengths at most)
    trainer = trainer_for(os.path.join(out, "zero2_tokens_tuned"), stage=2, tuned=True, micro_batching="tokens")
    trainer.train()
    result["zero2_tokens_tuned"] = full_weights(trainer)
    result["zero2_tokens_tuned_engine"] = engine_record(trainer)
    result["zero2_tokens_tuned_trials"] = [t.__dict__ for t in trainer.probe_result.trials]
    # a second tuned run in the same output_dir finds the stored plan (same key): no probe, the plan applied as given
    again = trainer_for(os.path.join(out, "zero2_tuned"), stage=2, tuned=True, probe_max_micro_batch=2, max_steps=1)
    again.train()
    result["zero2_reused"] = {"probed": again.probe_result is not None, "engine": engine_record(again)}
    # resume: an uninterrupted ZeRO-3 run of 4 steps vs one stopped after its checkpoint at step 2, then resumed
    full = trainer_for(os.path.join(out, "resume_full"), stage=3, max_steps=4)
    full.train()
    result["resume_full"] = full_weights(full)
    split = os.path.join(out, "resume_split")
    trainer_for(split, stage=3, max_steps=4, save_steps=2, callbacks=[StopAt(2)]).train()
    resumed = trainer_for(split, stage=3, max_steps=4, save_steps=2)
    resumed.train(resume_from_checkpoint=os.path.join(split, "checkpoint-2"))
    result["resumed"] = full_weights(resumed)
    result["resumed_engine"] = engine_record(resumed)
    with open(os.path.join(split, "checkpoint-2", "hf_accum_plan.json")) as f:
        result["checkpoint_plan"] = json.load(f)["plan"]
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def oom_mode(out, rank):
    from hf_accum import AccumTrainer, AccumTrainingArguments
    from tests.exactness import tiny_gpt2, train_recording_outcome
    from tests.trainer.test_oom_recovery import OOMAt

    try:
        args = AccumTrainingArguments(output_dir=os.path.join(out, "world_one"), report_to=[], use_cpu=False,
                                      deepspeed=ds_config(2))
        AccumTrainer(model=tiny_gpt2(), args=args)
        message = None
    except ValueError as exc:
        message = str(exc)
    try:  # a float64 model under ZeRO-3: refused when the trainer is built, before any work
        trainer_for(os.path.join(out, "float64"), stage=3, dtype=torch.float64)
        float64 = None
    except ValueError as exc:
        float64 = str(exc)
    # the folder is shared and only rank 0 makes (and removes) it: rank 1 looks once rank 0 has refused too
    assert torch.distributed.is_initialized(), "the float64 run's arguments set up the process group"
    torch.distributed.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"world_one": message, "zero3_float64": float64,
                   "left": [d for d in ("world_one", "float64") if os.path.exists(os.path.join(out, d))]}, f)
    trainer = trainer_for(os.path.join(out, "oom"), stage=3)
    if rank == 1:
        OOMAt(trainer.model, [3])
    # rank 1 prints its traceback and exits cleanly, so rank 0 (which learns of the stop when rank 1 leaves) is not
    # ended by the launcher's SIGTERM before it writes its record (a CI run of the oldest env lost it so)
    train_recording_outcome(trainer, os.path.join(out, f"oom.rank{rank}.json"), reraise=rank != 1, show=rank == 1)


def probe_oom_mode(out, rank):
    """auto_tune under ZeRO-3, out of memory in rank 1's first probe trial (its second forward, after the warm-up):
    every rank must stop, none hang, and the weights must never have been stepped."""
    from tests.exactness import train_recording_outcome
    from tests.trainer.test_oom_recovery import OOMAt

    trainer = trainer_for(os.path.join(out, "probe_oom"), stage=3, tuned=True)
    if rank == 1:
        OOMAt(trainer.model, [2])
    train_recording_outcome(trainer, os.path.join(out, f"probe_oom.rank{rank}.json"), reraise=rank != 1)


class FakeEngine:
    """Records what accelerate's DeepSpeed wrapper asks of the engine."""

    def __init__(self):
        self.calls = []

    def set_gradient_accumulation_boundary(self, is_boundary):
        self.calls.append(f"boundary={is_boundary}")

    def backward(self, loss, **kwargs):
        self.calls.append("backward")

    def step(self):
        self.calls.append("step")


def single_mode(out, rank):
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper
    from deepspeed.comm.torch import build_shm_op

    from hf_accum.compat import deepspeed_integration
    from hf_accum.probing.plan import Plan
    from hf_accum.window.protocol import StopTraining
    from tests.trainer.test_oom_recovery import OOMAt

    result = {"shm_op": build_shm_op() is not None}
    trainer = trainer_for(os.path.join(out, "fill"), stage=2, micro=4)
    trainer.apply_plan(Plan(1, 8, 1, 8))
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    result["filled"] = {k: config[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                               "train_batch_size")}
    result["args_config_is_plugins"] = trainer.args.hf_deepspeed_config.config is config
    result["label"] = deepspeed_integration.engine_label(trainer)
    result["describe"] = trainer.plan.describe()
    result["args"] = [trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps]

    fake = FakeEngine()
    trainer.accelerator.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(fake)
    loss = torch.ones((), requires_grad=True)
    for final in (False, True):
        with deepspeed_integration.engine_boundary(trainer, final):
            trainer.accelerator.backward(loss)
    result["engine_calls"] = fake.calls
    result["sync_after"] = trainer.accelerator.sync_gradients

    explicit = trainer_for(os.path.join(out, "explicit"), stage=2, micro=4)
    explicit.args.deepspeed = {**ds_config(2), "train_micro_batch_size_per_gpu": 2}
    try:
        explicit.apply_plan(Plan(1, 8, 1, 8))  # e.g. a resumed checkpoint's downgraded plan
        result["explicit"] = None
    except ValueError as exc:
        result["explicit"] = str(exc)

    oom = trainer_for(os.path.join(out, "oom"), stage=2, micro=4)
    OOMAt(oom.model, [3])
    try:
        oom.train()
        result["oom"] = None
    except StopTraining as exc:
        result["oom"] = str(exc)
    result["oom_steps"] = oom.state.global_step
    try:
        trainer_for(os.path.join(out, "tune_first"), stage=3, tuned=True).tune()
        result["tune_before_train"] = None
    except ValueError as exc:
        result["tune_before_train"] = str(exc)
    with open(os.path.join(out, "single.json"), "w") as f:
        json.dump(result, f)


def defaults_mode(out, rank):
    """One process, ZeRO-2, default arguments: max_nonfinite_steps left unset trains (one line says what non-finite
    losses do); an explicit one is refused; auto_tune under a 64 MiB budget with DeepSpeed's default buckets is refused
    with a message naming the bucket keys."""
    import logging

    from hf_accum.probing.loop import NothingFitsError

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("hf_accum").addHandler(handler)
    logging.getLogger("hf_accum").setLevel(logging.INFO)
    result = {}
    trainer = trainer_for(os.path.join(out, "plain"), stage=2, max_steps=2)
    trainer.train()
    result["steps"] = trainer.state.global_step
    result["limit"] = trainer._nonfinite_limit  # the resolved limit (trainer.args keeps "auto")
    result["lines"] = [r for r in records if "max_nonfinite_steps" in r]
    try:
        trainer_for(os.path.join(out, "explicit"), stage=2, max_nonfinite_steps=3)
        result["explicit"] = None
    except ValueError as exc:
        result["explicit"] = str(exc)
    tuned = trainer_for(os.path.join(out, "tuned"), stage=2, tuned=True, memory_budget_bytes=64 * 2**20)
    try:
        tuned.train()
        result["nothing_fits"] = None
    except NothingFitsError as exc:
        result["nothing_fits"] = str(exc)
    # the advice taken: the buckets the message suggests, the same budget
    small = {"reduce_bucket_size": 100000, "allgather_bucket_size": 100000}
    advised = trainer_for(os.path.join(out, "advised"), stage=2, tuned=True, memory_budget_bytes=64 * 2**20,
                          zero=small, max_steps=1)
    advised.train()
    result["advised_plan"] = advised.plan.describe()
    result["advised_peak"] = advised.probe_result.trials[0].peak_bytes
    with open(os.path.join(out, "defaults.json"), "w") as f:
        json.dump(result, f)


def main():
    modes, out = sys.argv[1], sys.argv[2]
    skip_shm_comm_op()
    rank = int(os.environ.get("RANK", 0))
    for mode in modes.split(","):  # e.g. "single,defaults": one launch, the modes in turn
        {"train": train_mode, "oom": oom_mode, "probe_oom": probe_oom_mode, "single": single_mode,
         "defaults": defaults_mode}[mode](out, rank)


if __name__ == "__main__":
    main()
