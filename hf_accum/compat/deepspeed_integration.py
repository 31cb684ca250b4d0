"""DeepSpeed, through transformers' and accelerate's integration: the ZeRO stage, the config's batch fields, the
engine's accumulation boundary and its state. Pinned by tests/compat/test_compat.py and tests/workers/deepspeed_worker.py.
"""

from __future__ import annotations

import contextlib

import torch


def deepspeed_enabled(trainer) -> bool:
    """The Trainer resumes through DeepSpeed's engine (`Trainer.is_deepspeed_enabled`, set from accelerate's state)."""
    return bool(getattr(trainer, "is_deepspeed_enabled", False))


def deepspeed_zero3_enabled() -> bool:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


def engine_steps_in_backward(trainer) -> bool:
    """DeepSpeed's engine takes the optimizer step inside `backward` at the accumulation boundary."""
    from accelerate.utils import DistributedType

    return trainer.accelerator.distributed_type is DistributedType.DEEPSPEED


def deepspeed_user_config(value) -> dict:
    """The DeepSpeed config as the user gave it (`TrainingArguments.deepspeed`: a dict, a JSON file's path or a JSON
    string), "auto" fields intact; parsed by accelerate's `HfDeepSpeedConfig`, which copies and never fills."""
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    return HfDeepSpeedConfig(value).config


def deepspeed_stage(trainer) -> int | None:
    """The ZeRO stage of the engine accelerate builds; None when DeepSpeed is not in use."""
    if not engine_steps_in_backward(trainer):
        return None
    return int(trainer.accelerator.state.deepspeed_plugin.zero_stage)


def engine_name(stage: int) -> str:
    """How plans, plan keys and messages name a DeepSpeed engine of ZeRO ``stage``."""
    return f"DeepSpeed ZeRO-{stage}"


def engine_label(trainer) -> str | None:
    """The sharded engine a plan runs on, as plans and plan keys name it ("DeepSpeed ZeRO-3"); None otherwise."""
    stage = deepspeed_stage(trainer)
    return None if stage is None else engine_name(stage)


def fill_deepspeed_config(trainer) -> None:
    """Make the config accelerate builds the DeepSpeed engine from (in `train()`) hold the plan now in the arguments.

    transformers fills a config's "auto" fields once, in `TrainingArguments.__post_init__`, from the batch settings
    given then (before any plan: micro 8 × accumulation 1 for a tuned run); accelerate's `_prepare_deepspeed`
    reads `deepspeed_plugin.hf_ds_config` / `deepspeed_config`. As transformers' own hyperparameter search does, a
    fresh `HfTrainerDeepSpeedConfig` of the user's config ("auto" intact) is filled from the current arguments and
    replaces both (and `args.hf_deepspeed_config`, which `is_deepspeed_zero3_enabled` reads through a weakref)."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    args = trainer.args
    config = HfTrainerDeepSpeedConfig(args.deepspeed)
    config.trainer_config_process(args)
    args.hf_deepspeed_config = config
    plugin = trainer.accelerator.state.deepspeed_plugin
    plugin.hf_ds_config = config
    plugin.deepspeed_config = config.config


def deepspeed_batch_config(trainer) -> dict:
    """The config accelerate will build (or built) the engine from."""
    return trainer.accelerator.state.deepspeed_plugin.deepspeed_config


@contextlib.contextmanager
def engine_boundary(trainer, final: bool):
    """One chunk's backward under DeepSpeed, with the engine's accumulation boundary set to ``final``.

    accelerate's `DeepSpeedEngineWrapper.backward` sets the engine's boundary from `accelerator.sync_gradients` and
    calls `engine.step()` when it is true; transformers sets `sync_gradients` per *loaded* batch. When hf_accum cuts
    the window's last loaded batch into chunks (OOM recovery, token budgets), every chunk would step; so it is set
    per chunk: true for the window's final chunk only (the engine then steps exactly once per window whatever the
    cut), restored after. DeepSpeed's own micro-step counter is never relied on."""
    if not engine_steps_in_backward(trainer):
        yield
        return
    state = trainer.accelerator.gradient_state
    saved = state.sync_gradients
    state._set_sync_gradients(final)
    try:
        yield
    finally:
        state._set_sync_gradients(saved)


def deepspeed_engine(trainer):
    """The live DeepSpeed engine `train()` built (`Trainer.model_wrapped`, also kept as `trainer.deepspeed`)."""
    return trainer.model_wrapped


# What `DeepSpeedEngine.load_checkpoint` does not put back: its micro-step counter (the others are in the checkpoint).
_ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


@contextlib.contextmanager
def deepspeed_state_restored(trainer, scratch: str):
    """Run the block (the probe's real steps through the engine), then put the engine back as it was: weights (its
    fp32 master partitions and the module's), optimizer state, its LR scheduler and its step counters. ZeRO keeps
    these in its own partitions, so they are saved and loaded the way transformers resumes a DeepSpeed run
    (`engine.save_checkpoint` / `load_checkpoint`, every rank, collectively) into ``scratch``, removed after.

    Restored only when the block ends normally: after an error some rank may sit in a collective, and the run
    stops anyway (the user's own checkpoints are never touched)."""
    import shutil

    from transformers.trainer import _is_peft_model

    engine = deepspeed_engine(trainer)
    counters = {name: getattr(engine, name) for name in _ENGINE_COUNTERS}
    tag = "hf_accum_probe"
    engine.save_checkpoint(scratch, tag=tag)
    try:
        yield
    except BaseException:
        if trainer.args.should_save:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    load_path, _ = engine.load_checkpoint(scratch, tag=tag, load_module_strict=not _is_peft_model(trainer.model),
                                          load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"hf_accum: DeepSpeed could not load back the state saved before the probe ({scratch})")
    for name, value in counters.items():
        setattr(engine, name, value)
    torch.distributed.barrier()  # every rank has read its partition before the folder goes
    if trainer.args.should_save:
        shutil.rmtree(scratch, ignore_errors=True)
    torch.distributed.barrier()  # and it is gone on every rank when the probe returns, not only on the one removing it


def deepspeed_buckets(trainer) -> dict[str, int]:
    """The sizes, in elements, of the communication buffers the live engine's ZeRO optimizer allocates, by the
    DeepSpeed config key that sets each (DeepSpeed's defaults, 5e8 for ZeRO-1/2, where the config sets none)."""
    zero = deepspeed_engine(trainer)._config.zero_config
    stage = int(zero.stage)
    if stage == 0:
        return {}
    if stage < 3:
        return {"reduce_bucket_size": int(zero.reduce_bucket_size), "allgather_bucket_size": int(zero.allgather_bucket_size)}
    return {"reduce_bucket_size": int(zero.reduce_bucket_size), "stage3_prefetch_bucket_size": int(zero.prefetch_bucket_size)}


def set_deepspeed_batch(trainer, micro: int, accumulation: int) -> None:
    """The plan on the live engine, through its own setters (the micro-batch first: `set_train_batch_size` keeps
    it and derives the accumulation), and in the config accelerate and the arguments hold, which is what is saved.
    hf_accum still sets the accumulation boundary per chunk (`engine_boundary`): the engine's counter is only
    what it reports."""
    engine = deepspeed_engine(trainer)
    engine.set_train_micro_batch_size(micro)
    engine.set_train_batch_size(micro * accumulation * engine.dp_world_size)
    for config in {id(c): c for c in (deepspeed_batch_config(trainer), trainer.args.hf_deepspeed_config.config)}.values():
        config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation,
                      train_batch_size=engine.train_batch_size())


def refuse_zero3_float64(trainer) -> None:
    """DeepSpeed's ZeRO-3 shards float32, bfloat16 and float16 parameters only (`zero.Init` asserts it when the
    engine is built). Whether a float64 model gets past that assertion depends on the machine: DeepSpeed 0.18-0.19's
    `partition_parameters._set_dtype` reads ``dtype or float16 if fp16_supported else bfloat16`` (precedence), so on a
    CPU whose oneDNN reports no fp16 (no AVX512-FP16 / AMX-FP16) the float64 asked for becomes bfloat16, the
    assertion passes and the parameters stay float64 beside float32 master weights; on a GPU, or a CPU with fp16, it
    fails inside `deepspeed.initialize`. Refused everywhere, before any work, naming the fix."""
    if trainer.model is None or deepspeed_stage(trainer) != 3:
        return
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    if any(p.dtype == torch.float64 and not is_zero_param(p) for p in trainer.model.parameters()):
        raise ValueError("deepspeed: ZeRO-3 cannot shard float64 parameters (DeepSpeed takes float32, bfloat16 or "
                         "float16): cast the model first (model.float()), or use ZeRO stage 2.")
