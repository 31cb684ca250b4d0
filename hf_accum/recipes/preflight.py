"""What the output directory and `resume_from_checkpoint` decide before any model or data work: a run that would
lose or change the user's files is refused here, with nothing written.

- `output_dir` must be a directory that can be created or written to;
- a plan stored in `output_dir` (a finished or stopped run, or `hf-accum probe RECIPE output_dir=...`) for another
  `target_batch_size` is refused: that run's plan, recipe and checkpoints stay as they are;
- checkpoints in `output_dir` are continued only when asked (`resume_from_checkpoint=true|PATH`), never
  overwritten by a run starting again from step 0;
- `resume_from_checkpoint=true` means the newest complete checkpoint (`checkpoints.newest_complete_checkpoint`),
  a path must be a checkpoint directory. What a checkpoint must hold to be resumed is the Trainer's rule.
"""

from __future__ import annotations

import os
import re

from ..config.paths import PLAN_FILE, can_create_in, nearest_existing
from .files import RecipeError

_CHECKPOINT = re.compile(r"^checkpoint-\d+$")


def requested_target(args) -> int:
    return args.target_batch_size or args.effective_batch_size


def stored_target(folder: str) -> int | None:
    """The `target_batch_size` of the plan stored in ``folder``, read through the planner's store; None when there is
    no valid one (the trainer then says what is wrong with it, or plans anew)."""
    from ..planning.store import PlanFileError, load_stored_plan  # imports torch: called once the run has it

    try:
        plan = load_stored_plan(folder)
    except PlanFileError:
        return None
    return None if plan is None else plan.target_batch_size


def check_writable(output_dir: str) -> None:
    """A directory, or a path one can be created at; checked by the CLI before anything heavy is imported."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise RecipeError(f"training.output_dir={output_dir!r} is a file; pass output_dir=DIR with a directory")
    parent = nearest_existing(output_dir)
    if not can_create_in(parent):
        raise RecipeError(f"training.output_dir={output_dir!r} cannot be written ({parent} is not a writable "
                          "directory); pass output_dir=DIR with a writable place")


def check_output_dir(output_dir: str, target: int, *, what: str = "run") -> None:
    """Writable, and not holding a plan for another target."""
    check_writable(output_dir)
    stored = stored_target(output_dir)
    if stored is not None and stored != target:
        raise RecipeError(
            f"output_dir={output_dir!r} holds a run planned for target_batch_size={stored} "
            f"({os.path.join(output_dir, PLAN_FILE)}), but this {what} asks for target_batch_size={target}; "
            f"keep target_batch_size={stored} to continue it, or pass output_dir=ANOTHER_DIR (nothing was changed)"
        )


def checkpoints(output_dir: str) -> list[str]:
    if not os.path.isdir(output_dir):
        return []
    names = [n for n in os.listdir(output_dir) if _CHECKPOINT.match(n)]
    return sorted(names, key=lambda n: int(n.split("-")[1]))


def resolve_resume(value, output_dir: str, target: int) -> str | None:
    """The checkpoint directory to resume from (None: a new run), or a RecipeError saying what to set."""
    if value in (None, False, ""):
        found = checkpoints(output_dir)
        if found:
            raise RecipeError(
                f"output_dir={output_dir!r} holds checkpoints of an earlier run (newest: {found[-1]}) that a new run "
                "would overwrite; continue it with resume_from_checkpoint=true, or pass output_dir=ANOTHER_DIR "
                "(nothing was changed)"
            )
        return None
    if value is True:
        from ..trainer.resilience.checkpoints import inspect_checkpoint, newest_complete_checkpoint

        path = newest_complete_checkpoint(output_dir, say_skipped=True)  # a newer one passed over is named, and why
        if path is None:
            why = "; ".join(f"{name}: {inspect_checkpoint(os.path.join(output_dir, name)).problem}"
                            for name in checkpoints(output_dir)) or "it has no checkpoint-N folder"
            raise RecipeError(
                f"resume_from_checkpoint=true, but output_dir={output_dir!r} holds no complete checkpoint ({why}); "
                "start over with output_dir=ANOTHER_DIR (these folders stay as they are)"
            )
    else:
        path = str(value)
        if not os.path.isdir(path):
            raise RecipeError(
                f"resume_from_checkpoint={path!r}: no such checkpoint directory; give a checkpoint-N directory, or "
                "true for the newest complete checkpoint in output_dir"
            )
        from ..trainer.resilience.checkpoints import inspect_checkpoint

        problem = inspect_checkpoint(path).problem  # before the model is built, as the trainer would refuse it after
        if problem:
            raise RecipeError(f"resume_from_checkpoint={path!r} cannot be resumed: {problem}; resume_from_checkpoint="
                              "true picks the newest complete checkpoint, or start over with output_dir=ANOTHER_DIR")
    stored = stored_target(path)
    if stored is not None and stored != target:
        raise RecipeError(
            f"resume_from_checkpoint={path!r} is a run trained with target_batch_size={stored}, but "
            f"target_batch_size={target} now; resume with target_batch_size={stored}, or start a new run in "
            "another output_dir (nothing was changed)"
        )
    return path
