"""What a stopped or refused run says: the message every rank stops with (and the plan to restart with), why a
run sharded at load cannot resume, how to go on from a checkpoint, and the exception a signal or too many
non-finite steps end `train()` with."""

from __future__ import annotations

import contextlib
import logging
import os

from . import finite_grads
from .preemption import EXIT_PREEMPTED, TORCHRUN_GRACE_S, Preempted

logger = logging.getLogger("hf_accum.trainer")  # the trainer's messages, under the logger they always had


def stop_message(trainer, reason: str) -> str:
    """The message every rank stops with after ``reason`` (a `StopTraining` inside the loop), naming what to
    restart with (the planner's next smaller plan)."""
    if trainer.planner.probing:
        return f"hf_accum: {reason}. Every rank stops before the first optimizer step; no weights were changed."
    if not trainer.engine.resumable:
        how = "Restart (a new run: a model sharded at load time cannot be resumed) with"
    elif trainer.args.save_only_model:
        how = "Restart (a new run from the last checkpoint's weights: save_only_model=True saves no optimizer state) with"
    else:
        how = "Restart (resume from the last checkpoint) with"
    setting = trainer.planner.restart_setting()
    return (
        f"hf_accum: {reason}; this cannot be recovered without risking diverging or hanging ranks, so every "
        f"rank stops. Checkpoints in {trainer.args.output_dir} are intact. {how} {setting}."
    )


def refuse_unresumable(engine, resume_from_checkpoint) -> None:
    """A model sharded at load time has no optimizer state in its checkpoints (its ``engine`` is not resumable):
    resuming it is refused."""
    if resume_from_checkpoint and not engine.resumable:
        raise ValueError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} cannot resume exactly: the model was sharded at "
            "load time (distributed_config=...), and transformers checkpoints no optimizer state for such a "
            "model. Train without resume_from_checkpoint: to go on from a checkpoint's weights, load them with "
            "from_pretrained(CHECKPOINT, distributed_config=...) as a new run (optimizer and schedule start "
            "over); for an exact resume under FSDP2, use hf_accum.loop with torch.distributed.checkpoint "
            "(its checkpointing recipe: python -c \"import hf_accum.loop; help(hf_accum.loop)\")."
        )


def resume_advice(trainer, where: str) -> str:
    """How to go on from the checkpoint ``where`` after a stop."""
    if not trainer.engine.resumable:
        return (f"This run cannot be resumed (its model was sharded at load time; transformers saves no optimizer "
                f"state for it): start a new run from the weights in {where} "
                "(from_pretrained(CHECKPOINT, distributed_config=...)); the optimizer and schedule start over.")
    if trainer.args.save_only_model:
        return (f"This run cannot be resumed (save_only_model=True: its checkpoints hold no optimizer or scheduler "
                f"state): start a new run from the weights in {where} (from_pretrained(CHECKPOINT)); the "
                "optimizer and schedule start over.")
    if trainer.resume_command:
        return f"Resume with: {trainer.resume_command}"
    return (f"Resume with trainer.train(resume_from_checkpoint={where!r}) (or resume_from_checkpoint=True for "
            f"the newest checkpoint in {trainer.args.output_dir}).")


def _saved_weights_said(trainer) -> str:
    # Non-finite steps are never taken, but an optimizer can make NaN from finite gradients (AdamW's eps
    # underflows to 0 in fp16 weights): the claim is checked, not assumed.
    if finite_grads.weights_finite(trainer.model.parameters()):
        return "finite weights"
    return ("weights that are NOT finite (an optimizer step with finite gradients made them NaN/inf, e.g. AdamW "
            "on fp16 weights; load them in float32 or bf16)")


def raise_if_stopped(trainer) -> None:
    """After the Trainer's loop ended early on our request: say where the checkpoint is and how to resume."""
    where = os.path.join(trainer.args.output_dir, f"checkpoint-{trainer.state.global_step}")
    limit = trainer._nonfinite_limit  # "auto" resolved for the engine (construction.py)
    if limit is not None and trainer._nonfinite_streak > limit:
        raise RuntimeError(
            f"hf_accum: {trainer._nonfinite_streak} optimizer steps in a row had a non-finite loss or gradients "
            f"(NaN/inf), more than max_nonfinite_steps={limit}; training stopped at step "
            f"{trainer.state.global_step} with {_saved_weights_said(trainer)} saved to {where}. Lower the learning "
            "rate, check the data around these steps, or enable bf16 instead of fp16; then go on from that "
            "checkpoint. " + resume_advice(trainer, where)
        )
    request = trainer._stop_request
    if trainer._engine is not None and trainer._engine.outcome.stop:
        took = request.seconds_since()
        late = (f" That took {took:.1f} s, longer than torchrun's {TORCHRUN_GRACE_S} s grace period: under a "
                "launcher the processes may be killed before the checkpoint is complete; save more often."
                if took > TORCHRUN_GRACE_S else f" ({took:.1f} s after the signal.)")
        message = (
            f"hf_accum: stopped by {request.signal_name or 'another rank'} after optimizer step "
            f"{trainer.state.global_step}; checkpoint saved to {where}.{late} {resume_advice(trainer, where)} "
            f"Exit code {EXIT_PREEMPTED}."
        )
        say_stopped(trainer, message)
        raise Preempted(message)
    if trainer.args.should_save:  # the run went on to its end: an earlier stop's note is out of date
        with contextlib.suppress(OSError):
            os.remove(os.path.join(trainer.args.output_dir, STOP_FILE))


STOP_FILE = "hf_accum_stopped.txt"  # in output_dir: the stop message and the command that resumes


def say_stopped(trainer, message: str) -> None:
    """The stop message where a person sees it: logged (a SystemExit prints nothing by itself), and where the
    Ctrl-C took a `| tee` reader of stderr down with the run, on the terminal itself; and written to
    output_dir/`STOP_FILE` (main process), which outlives any pipe."""
    from .output_guard import tell

    dead = trainer._stop_request.dead_streams
    if "stderr" in dead:
        tell(message, dead)
    else:
        logger.warning(message)
    if trainer.args.should_save:
        with contextlib.suppress(OSError):
            with open(os.path.join(trainer.args.output_dir, STOP_FILE), "w") as f:
                f.write(message + "\n")


@contextlib.contextmanager
def refusal_leaves_output_dir(trainer, starts: bool = True):
    """A run refused before training leaves output_dir as it found it: the empty folder transformers' __init__
    made is removed again (nothing else was written: the plan file comes after every check and the probe).
    ``starts=False``: the block passing does not start the run (the trainer's own checks in ``__init__``)."""
    try:
        yield
    except BaseException:
        made = trainer._made_output_dir
        if made is not None and trainer.args.should_save:  # one process per folder removes it
            with contextlib.suppress(OSError):  # gone already, or written to since: left as it is
                os.rmdir(made)
        raise
    if starts:
        trainer._made_output_dir = None  # the run started: the folder is its own, and a later refusal keeps it
