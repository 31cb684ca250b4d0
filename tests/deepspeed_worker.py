"""Run under `torchrun --nproc_per_node 2` (gloo, CPU, `use_cpu=True`): AccumTrainer under DeepSpeed ZeRO. Modes:
- train OUT: the same data and target (8: micro 2 × accumulation 2 × world 2) under DDP, ZeRO-2 and ZeRO-3 ("auto"
  batch fields), and ZeRO-2 with micro_batching="tokens" (each rank's window loaded whole and cut into several
  forwards by a token budget: the engine must step once per window, not per forward); then ZeRO-3 stopped after a
  checkpoint at step 2 and resumed from it in a new trainer. Saves per rank the final full weights, the engine's
  batch fields and step count, the plan and the forwards run.
- single OUT (one process, no launcher; world 1): the `_compat` pieces on a real DeepSpeed setup (the plan filled
  into the config accelerate builds the engine from, a contradicting explicit field refused when a plan is applied,
  accelerate's backward stepping the engine only when `engine_boundary` says final, the shm op skipped), and an
  out-of-memory error under DeepSpeed stopping a one-process run too (its engine's gradients cannot be cleared).
- oom OUT: use_cpu=False on CPU (each rank would see world 1) must be refused (message written per rank); then
  ZeRO-3 with an out-of-memory error injected in rank 1's third forward: every rank must stop, none hang.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def skip_shm_comm_op():
    """DeepSpeed's CPU accelerator JIT-compiles its shared-memory all-reduce op (`deepspeed_shm_comm`, 30-100 s, in
    ~/.cache/torch_extensions) when its comm backend starts; that op serves only `inference_all_reduce` (tensor-
    parallel inference), never training's collectives, which go through torch.distributed (gloo). Marking it
    incompatible, where DeepSpeed's own check reads it, skips the compile (pinned in tests/test_deepspeed.py)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def ds_config(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}


class CountForwards:
    def __init__(self, model):
        self.count = 0
        model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        if module.training:
            self.count += 1


def trainer_for(out, stage=None, max_steps=3, save_steps=None, callbacks=(), micro=2, accumulation=2, **kw):
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
        auto_tune=False, max_steps=max_steps, learning_rate=1e-2, max_grad_norm=0.0, report_to=[],
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, use_cpu=True, seed=0,
        disable_tqdm=True, remove_unused_columns=False, ddp_backend="gloo", logging_steps=1,
        deepspeed=ds_config(stage) if stage is not None else None,
        max_nonfinite_steps=None if stage is not None else 3, **kw,
    )
    trainer = AccumTrainer(model=tiny_gpt2(), args=args, train_dataset=lm_examples(40, seed=3),
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
            "describe": trainer.plan.describe() if trainer.plan else None}


def train_mode(out, rank):
    from tests.exactness import tiny_gpt2
    from tests.test_resume import StopAt

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
    from tests.test_oom_recovery import OOMAt

    try:
        args = AccumTrainingArguments(output_dir=os.path.join(out, "world_one"), report_to=[], use_cpu=False,
                                      deepspeed=ds_config(2), max_nonfinite_steps=None)
        AccumTrainer(model=tiny_gpt2(), args=args)
        message = None
    except ValueError as exc:
        message = str(exc)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"world_one": message}, f)
    trainer = trainer_for(os.path.join(out, "oom"), stage=3)
    if rank == 1:
        OOMAt(trainer.model, [3])
    train_recording_outcome(trainer, os.path.join(out, f"oom.rank{rank}.json"))


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

    from hf_accum import _compat
    from hf_accum.plan import Plan
    from hf_accum.protocol import StopTraining
    from tests.test_oom_recovery import OOMAt

    result = {"shm_op": build_shm_op() is not None}
    trainer = trainer_for(os.path.join(out, "fill"), stage=2, micro=4)
    trainer.apply_plan(Plan(1, 8, 1, 8))
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    result["filled"] = {k: config[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                               "train_batch_size")}
    result["args_config_is_plugins"] = trainer.args.hf_deepspeed_config.config is config
    result["label"] = _compat.engine_label(trainer)
    result["describe"] = trainer.plan.describe()
    result["args"] = [trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps]

    fake = FakeEngine()
    trainer.accelerator.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(fake)
    loss = torch.ones((), requires_grad=True)
    for final in (False, True):
        with _compat.engine_boundary(trainer, final):
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
    with open(os.path.join(out, "single.json"), "w") as f:
        json.dump(result, f)


def main():
    mode, out = sys.argv[1], sys.argv[2]
    skip_shm_comm_op()
    rank = int(os.environ.get("RANK", 0))
    {"train": train_mode, "oom": oom_mode, "single": single_mode}[mode](out, rank)


if __name__ == "__main__":
    main()
