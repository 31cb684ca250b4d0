"""The value checks behind `AccumTrainingArguments.__post_init__` that need no arguments object: booleans, positive
numbers, evaluation/save intervals, the non-finite step limit, and the accumulation to suggest for a target. Each
message names the argument and the fix."""

from __future__ import annotations

DEFAULT_MAX_NONFINITE_STEPS = 3  # max_nonfinite_steps="auto" where hf_accum takes the optimizer step


def parse_nonfinite_limit(value):
    """``max_nonfinite_steps`` as given in Python, YAML or on the command line (where HfArgumentParser passes a
    string): "auto", None or an integer >= 0."""
    if isinstance(value, str) and value.strip().lower() in ("none", "null"):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise ValueError(f"max_nonfinite_steps={value!r} must be 'auto' (the engine's default), an integer >= 0 (0: stop "
                     "at the first non-finite loss) or None (no check).")


def resolve_nonfinite_limit(value, engine_steps_in_backward: bool) -> tuple[int | None, str | None]:
    """The limit a run uses and, for "auto", the one line saying what non-finite losses do on this engine. A number
    set explicitly where the engine steps inside backward (DeepSpeed) is refused: hf_accum could not drop the
    window's gradients before the step."""
    if value == "auto" and engine_steps_in_backward:
        return None, ("hf_accum: max_nonfinite_steps is off under DeepSpeed (its engine steps the optimizer inside "
                      "backward, before hf_accum could drop a window's gradients): a non-finite loss is left to "
                      "DeepSpeed's optimizer, whose overflow check skips the step or not depending on its precision "
                      "and config; watch the logged loss.")
    if value == "auto":
        return DEFAULT_MAX_NONFINITE_STEPS, (
            f"hf_accum: a window with a non-finite loss is skipped (its gradients dropped); more than "
            f"{DEFAULT_MAX_NONFINITE_STEPS} in a row stop training with a checkpoint (max_nonfinite_steps).")
    if value is not None and engine_steps_in_backward:
        raise ValueError(
            f"max_nonfinite_steps={value} is set, but DeepSpeed steps the optimizer inside backward, before hf_accum "
            "could drop a non-finite window's gradients. Leave max_nonfinite_steps unset ('auto': off under "
            "DeepSpeed) or set it to None."
        )
    return value, None


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def require_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False.")


# Step intervals transformers takes as a count (>= 1) or a ratio of the run's steps (< 1); a negative one passes its
# checks and then saves, evaluates or logs never or at every step, without a word.
INTERVALS = ("save_steps", "eval_steps", "logging_steps")
INTERVAL_FIX = "give a number of optimizer steps (e.g. {name}=500), or a ratio of the run's steps in (0, 1)"
SAVE_TOTAL_LIMIT_FIX = "give how many checkpoints to keep (e.g. save_total_limit=2), or leave it unset to keep all"


def check_intervals(args) -> None:
    for name in INTERVALS:
        value = getattr(args, name)
        if is_number(value) and value < 0:
            raise ValueError(f"{name}={value!r} is negative: {INTERVAL_FIX.format(name=name)}.")
    if is_number(args.save_total_limit) and args.save_total_limit < 0:
        raise ValueError(f"save_total_limit={args.save_total_limit!r} is negative: {SAVE_TOTAL_LIMIT_FIX}.")


def require_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer.")


def suggest_accumulation(target: int, micro: int, world: int) -> str:
    """The sentence telling the user which setting makes micro x accumulation x world equal the target."""
    if target % (micro * world) == 0:
        return f"Set gradient_accumulation_steps={target // (micro * world)}."
    per_rank = target // world if target % world == 0 else None
    if per_rank is None:
        return f"target_batch_size must be a multiple of the world size {world}."
    return (
        f"{target} is not a multiple of per_device_train_batch_size x world size = {micro * world}; "
        f"pick a per_device_train_batch_size that divides {per_rank} (e.g. {_largest_divisor_le(per_rank, micro)}) "
        "and set gradient_accumulation_steps accordingly."
    )


def _largest_divisor_le(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)
