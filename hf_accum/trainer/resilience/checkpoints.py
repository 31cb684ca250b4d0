"""Which checkpoint a run may resume, and with which plan.

A checkpoint belongs to its run's target batch: resuming it with another target would skip or repeat samples. Its
target is known from two places: the plan file (`hf_accum_plan.json`, written by the trainer's `on_save`, so
*after* transformers' `trainer_state.json`) and the arguments transformers saves first (`training_args.bin`).

A checkpoint is *complete* when its `trainer_state.json` reads, its files would load (safetensors as long as their
headers say, torch archives with a readable zip directory, JSON that parses: `checkpoint_files.unreadable_file`;
a copy cut short or a disk that filled up leaves them truncated), it holds optimizer and scheduler state the run
can load, and, if the arguments it was written with set a `target_batch_size` (or it holds a plan file at all), its
plan reads and is valid. A run killed between `trainer_state.json` and the plan leaves an incomplete checkpoint; one
written with `save_only_model=True` holds only weights (transformers would resume it with a fresh optimizer and
schedule, without a word). `resume_from_checkpoint=True` skips incomplete checkpoints (and says so), an explicit
path to one is refused with the way out. Checkpoints of plain `Trainer` runs (no target, no plan file) stay
resumable.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass

from ...compat import checkpoint_files
from ...config.settings import Settings
from ...planning.store import PLAN_FILE, PlanFileError, load_stored_plan
from ...probing.plan import Plan

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME, written last by _save_checkpoint
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR naming


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    plan: Plan | None  # the plan stored with it, when readable
    target_batch_size: int | None  # the run's target: the plan's, else its saved arguments'
    problem: str | None  # why it cannot be resumed; None when complete
    optimizer_problem: str | None = None  # why the run would not load its optimizer / scheduler state
    optimizer_state: frozenset[str] = frozenset()  # the kinds it holds (`checkpoint_files.optimizer_state_kinds`)

    @property
    def complete(self) -> bool:
        return self.problem is None


def inspect_checkpoint(path: str, deepspeed: bool | None = None) -> CheckpointInfo:
    """What ``path`` holds, and why it is not complete (None when it is). ``deepspeed``: whether the resuming run
    loads optimizer state through DeepSpeed's engine (None, unknown: either kind counts)."""
    problem = _state_problem(path) or _file_problem(path)
    saved = checkpoint_files.saved_training_args(path) or {}
    kinds = checkpoint_files.optimizer_state_kinds(path)
    optimizer = _optimizer_problem(kinds, deepspeed, saved)
    problem = problem or optimizer
    saved_target = saved.get("target_batch_size")
    saved_target = saved_target if isinstance(saved_target, int) and not isinstance(saved_target, bool) else None
    plan = None
    try:
        plan = load_stored_plan(path)
    except PlanFileError as exc:
        problem = problem or f"its plan file is corrupt: {exc}"
    else:
        if plan is None and saved_target is not None:
            problem = problem or (
                f"its plan file {PLAN_FILE} is missing, although the run had target_batch_size={saved_target} (the "
                "run was probably stopped while the checkpoint was written)"
            )
    target = plan.target_batch_size if plan is not None else saved_target
    return CheckpointInfo(path, plan, target, problem, optimizer, kinds)


def _optimizer_problem(kinds: frozenset[str], deepspeed: bool | None, saved: dict) -> str | None:
    if (deepspeed is None and kinds) or (deepspeed and "deepspeed" in kinds) or (deepspeed is False and "trainer" in kinds):
        return None
    lost = "resuming it would restart the optimizer's state (AdamW's moments) and the learning-rate schedule"
    if not kinds:
        how = " (it was saved with save_only_model=True)" if saved.get("save_only_model") is True else ""
        return f"it holds no optimizer or scheduler state{how}: {lost}"
    if deepspeed:
        return f"its optimizer state is not DeepSpeed's (no global_step* folder), which this DeepSpeed run cannot load: {lost}"
    return f"its optimizer state is DeepSpeed's (a global_step* folder), which this run without DeepSpeed would not load: {lost}"


def _state_problem(path: str) -> str | None:
    state = os.path.join(path, TRAINER_STATE)
    if not os.path.isfile(state):
        return f"{TRAINER_STATE} is missing (the run was stopped while the checkpoint was written)"
    try:
        with open(state) as f:
            json.load(f)["global_step"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        return f"{TRAINER_STATE} is unreadable ({type(exc).__name__}: {exc})"
    return None


def _file_problem(path: str) -> str | None:
    broken = checkpoint_files.unreadable_file(path, skip=(TRAINER_STATE, PLAN_FILE))  # those two: their own words
    return broken and f"its file {broken}"


def checkpoints_in(output_dir: str) -> list[str]:
    """The checkpoint folders of ``output_dir``, newest (highest step) first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir)
             if (m := _CHECKPOINT.match(name)) and os.path.isdir(os.path.join(output_dir, name))]
    return [os.path.join(output_dir, name) for _, name in sorted(found, reverse=True)]


def newest_complete_checkpoint(output_dir: str, deepspeed: bool | None = None, say_skipped: bool = False) -> str | None:
    """The highest-step checkpoint of ``output_dir`` that can be resumed; None when there is none. ``say_skipped``:
    warn, one line each, about the newer checkpoints passed over and why."""
    found, skipped = _pick_newest(output_dir, deepspeed)
    if say_skipped and found is not None:
        _say_skipped(skipped)
    return found and found.path


def _pick_newest(output_dir: str, deepspeed: bool | None) -> tuple[CheckpointInfo | None, list[CheckpointInfo]]:
    skipped = []
    for path in checkpoints_in(output_dir):
        info = inspect_checkpoint(path, deepspeed)
        if info.complete:
            return info, skipped
        skipped.append(info)
    return None, skipped


def _say_skipped(skipped: list[CheckpointInfo]) -> None:
    for other in skipped:
        logger.warning("hf_accum: skipping %s: %s.", other.path, other.problem)


def check_resume(args, resume_from_checkpoint, deepspeed: bool | None = None) -> tuple[str | bool | None, Plan | None]:
    """Before `train()` does anything: which checkpoint to resume (``True`` becomes the newest complete one,
    named in a warning) and the plan stored with it; or a ValueError when the checkpoint is incomplete (its
    optimizer state is read as a run with or without ``deepspeed`` loads it) or belongs to another target batch.
    Without resuming, the output_dir's newest checkpoint must not belong to another target either. Returns
    ``(resume_from_checkpoint, stored plan)``."""
    target = Settings(args).exact_target()
    # Nothing to resume: refused here, before the probe, in transformers' own words (its tests match them) + the fix.
    if isinstance(resume_from_checkpoint, str) and not os.path.isdir(resume_from_checkpoint):
        raise ValueError(
            f"Can't find a valid checkpoint at {resume_from_checkpoint}: no such directory. Pass "
            "resume_from_checkpoint=PATH of a checkpoint-N folder, True for the newest complete checkpoint in "
            f"output_dir ({args.output_dir}), or leave it unset to start a new run."
        )
    if resume_from_checkpoint is True and not checkpoints_in(args.output_dir):
        raise ValueError(
            f"No valid checkpoint found in output directory ({args.output_dir}): resume_from_checkpoint=True has no "
            "checkpoint-N folder to resume. Leave resume_from_checkpoint unset to start a new run, or pass the path "
            "of a checkpoint."
        )
    if isinstance(resume_from_checkpoint, str):
        info = inspect_checkpoint(resume_from_checkpoint, deepspeed)
        if not info.complete:
            raise ValueError(_incomplete_message(info, args, deepspeed))
    elif resume_from_checkpoint:  # True: transformers would take the newest folder, complete or not
        info = _newest_complete(args.output_dir, deepspeed)
        resume_from_checkpoint = info.path
    else:
        known = (inspect_checkpoint(p) for p in checkpoints_in(args.output_dir))
        info = next((i for i in known if i.target_batch_size is not None), None)
        if info is None:
            return resume_from_checkpoint, None
    if info.target_batch_size is not None and info.target_batch_size != target:
        raise ValueError(
            f"{info.path} holds a run trained with target_batch_size={info.target_batch_size}, but "
            f"target_batch_size={target} now. Resume with target_batch_size={info.target_batch_size}, or "
            "start the new run in another output_dir."
        )
    return resume_from_checkpoint, info.plan


def _newest_complete(output_dir: str, deepspeed: bool | None) -> CheckpointInfo:
    info, skipped = _pick_newest(output_dir, deepspeed)
    if info is not None:
        _say_skipped(skipped)
        logger.warning("hf_accum: resume_from_checkpoint=True: resuming from %s, the newest complete "
                       "checkpoint in %s.", info.path, output_dir)
        return info
    why = "".join(f" {i.path}: {i.problem}." for i in skipped)
    weights = next((i.path for i in skipped if i.optimizer_problem and _state_problem(i.path) is None), None)
    raise ValueError(
        f"resume_from_checkpoint=True, but {output_dir} holds no complete checkpoint.{why or ' It has no checkpoint-N folder.'} "
        "Train without resume_from_checkpoint to start over (in another output_dir to keep these folders)"
        + (f", or start a new run from the weights of {weights} with {_from_weights(weights)}." if weights else ".")
    )


def _from_weights(path: str) -> str:
    return (f"from_pretrained({path!r}) as the model, in another output_dir and without resume_from_checkpoint (the "
            "optimizer and schedule start over)")


def _incomplete_message(info: CheckpointInfo, args, deepspeed: bool | None = None) -> str:
    parent = os.path.dirname(os.path.abspath(info.path))
    older = next((p for p in checkpoints_in(parent) if os.path.abspath(p) != os.path.abspath(info.path)
                  and inspect_checkpoint(p, deepspeed).complete), None)
    ways = []
    target = Settings(args).exact_target()
    note = ""
    if info.target_batch_size is not None and info.target_batch_size != target:
        note = f" Whichever way, resume with target_batch_size={info.target_batch_size} (the run's), not {target}."
    if older is not None:
        ways.append(f"resume from {older}, the newest complete checkpoint (resume_from_checkpoint=True picks it)")
    intact = _state_problem(info.path) is None
    if info.optimizer_problem and intact:  # weights only, for this run
        if info.optimizer_state:
            ways.append(f"resume it {'without' if deepspeed else 'with'} DeepSpeed, as it was written")
        elif older is None:
            ways.append("resume from a checkpoint saved without save_only_model")
        ways.append(f"start a new run from its weights with {_from_weights(info.path)}")
        note = note and f" To resume, set target_batch_size={info.target_batch_size} (the run's), not {target}."
        return f"Cannot resume from {info.path}: {info.problem}. To go on: " + "; or ".join(ways) + "." + note
    if info.plan is None and info.target_batch_size is not None and intact:
        ways.append(
            f"if {info.path} is otherwise intact, write its plan back with "
            f"hf_accum.planning.store.restore_plan({info.path!r}, world_size={args.world_size}) and resume again"
        )
    ways.append("start over in another output_dir")
    return f"Cannot resume from {info.path}: {info.problem}. To go on: " + "; or ".join(ways) + "." + note
