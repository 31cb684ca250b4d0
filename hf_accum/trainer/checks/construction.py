"""What `AccumulationMixin` decides when it is constructed: the TRL trainer it is mixed into (and what that means for
the batch unit), every setup it cannot run exactly (refused here, naming what to set), and what it changes on its
own copy of the arguments."""

from __future__ import annotations

import logging
import weakref

from transformers import Trainer, TrainerCallback

from ... import levers
from ...compat import bitsandbytes_cpu
from ...config.arg_checks import resolve_nonfinite_limit
from ...config.settings import Settings
from . import lora_targets

logger = logging.getLogger("hf_accum.trainer")  # the trainer's messages, under the logger they always had


def refuse_unsupported_setups(trainer) -> None:
    """Every setup hf_accum cannot run exactly fails here, at construction, naming what to set."""
    levers.check_requests(trainer.model, trainer.args)
    problem = lora_targets.unmatched_target(trainer.model)  # a PEFT model, or the one TRL built from peft_config
    if problem:
        raise ValueError(problem)
    if trainer._trl is not None and trainer._normalization != "model":
        base, mixed = trainer._trl
        problem = mixed.check(trainer) if mixed.check else None
        if problem:
            raise ValueError(f"{type(trainer).__name__} (hf_accum over {base}): {problem}")
    trainer._nonfinite_limit = None  # plain arguments: no check (every step is taken, as transformers does)
    if hasattr(trainer.args, "max_nonfinite_steps"):
        limit, line = resolve_nonfinite_limit(trainer.args.max_nonfinite_steps, trainer.engine.steps_in_backward)
        # "auto" resolved for this engine, on the trainer: its arguments stay as given (`to_dict()` unchanged)
        trainer._nonfinite_limit = limit
        if line and trainer._normalization != "model":
            (logger.warning if limit is None else logger.info)(line)  # DeepSpeed's: nothing is skipped for you
    if trainer._normalization != "model" and trainer.args.n_gpu > 1:
        raise ValueError(
            f"loss_normalization={trainer._normalization!r} does not support torch.nn.DataParallel "
            f"(n_gpu={trainer.args.n_gpu}). Launch one process per GPU with `torchrun` or `accelerate launch` "
            "(DDP/FSDP), or set loss_normalization='model'."
        )


def keep_4bit_layers_unpacked(trainer) -> None:
    """Every 4-bit layer of every model the trainer holds stays out of bitsandbytes' CPU inference layout, in which
    training gradients are wrong (`compat.bitsandbytes_cpu`): before any forward of ours (the fused loss's check,
    the probe, evaluation), and again when training begins (``model_init`` makes a new model in `Trainer.train`)."""
    bitsandbytes_cpu.keep_unpacked(*bitsandbytes_cpu.trainer_modules(trainer))
    if trainer.model_init is not None:  # the only way a trainer gets a new model
        trainer.add_callback(_KeepUnpacked(trainer))


class _KeepUnpacked(TrainerCallback):
    """`keep_4bit_layers_unpacked` on the models of train() (before the first step). Holds the trainer weakly."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None:
            bitsandbytes_cpu.keep_unpacked(*bitsandbytes_cpu.trainer_modules(trainer))


def adjust_args_copy(trainer) -> None:
    """What the trainer changes on its own copy of the arguments once constructed (the caller's object is never
    written to)."""
    args = trainer.args
    if not trainer.engine.checkpoints_optimizer and not args.save_only_model:
        # transformers cannot checkpoint this model's optimizer state (a model sharded at load: `engines.fsdp`); the
        # checkpoints hf_accum itself writes when it stops (a signal, non-finite losses) then hold the weights
        # and the plan, not an optimizer file that could never be loaded. The stop messages say so.
        args.save_only_model = True
    if trainer._normalization != "model" and args.average_tokens_across_devices and args.world_size > 1:
        # We count across ranks ourselves; transformers' flag would gather and rescale the loss a second time.
        logger.info(
            "hf_accum: loss_normalization=%r normalizes over all ranks exactly; average_tokens_across_devices "
            "is off for this trainer (the arguments you passed are unchanged).", trainer._normalization,
        )
        args.average_tokens_across_devices = False
    if args.use_liger_kernel:  # one loss path (levers/kernels/liger.py); AccumTrainingArguments did it as it was made
        from ...levers.kernels import liger

        liger.configure(args, args.device.type)


def trl_base(cls: type, args) -> tuple[str, object] | None:
    """The TRL trainer ``cls`` mixes into and what hf_accum does over it (`hf_accum.integrations.trl.support.mixed_into`); raises, naming
    what to use, where hf_accum cannot cut its batches exactly."""
    if not any(c.__module__.split(".")[0] == "trl" and issubclass(c, Trainer) for c in cls.__mro__):
        return None
    from ...integrations.trl.support import mixed_into

    base, mixed = mixed_into(cls)
    if mixed.refusal and Settings(args).loss_normalization != "model":
        raise ValueError(f"{cls.__name__} mixes AccumulationMixin into {base}: {mixed.refusal}.")
    if cls.batch_unit is not None and mixed.unit is not None and cls.batch_unit != mixed.unit:
        raise ValueError(f"{cls.__name__} declares batch_unit={cls.batch_unit!r}, but {base} collates "
                         f"{mixed.unit}: set batch_unit={mixed.unit!r} (or leave it unset).")
    return base, mixed
