"""Pure planning: measurements + budget + target -> (micro-batch, accumulation).  Numbers in, numbers out.

Nothing here touches a device.  The pieces:

* the memory model: peak memory is close to ``a + b * micro`` at realistic lengths; it bends at small
  micro-batches, where the optimizer step (a fixed cost) sets the peak instead of the activations, so
  the line is fitted through the measured points nearest the budget, not through all of them;
* the search for the largest fitting micro-batch, `search.MicroBatchSearch` (its own module);
* :func:`plan_batch`: ``world`` ranks × a per-rank window of ``target / world`` samples, cut into the fewest
  forwards of at most the largest micro-batch that fits (near-equal; no divisor constraint, since the loss is
  normalized over the whole window), or a ``ValueError`` that says what to set instead.  The effective batch
  is never changed silently.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from ..window import step_time as step_model
from ..window.cuts import forwards_for


# --- arithmetic --------------------------------------------------------------------------------------
def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order (``divisors(12) == [1, 2, 3, 4, 6, 12]``)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"divisors() needs a positive integer, got {n!r}")
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i != n // i:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def forward_breakpoints(per_rank: int) -> list[int]:
    """The micro-batch sizes a plan can use for a per-rank window of ``per_rank`` samples: the smallest
    ``m`` reaching each forward count, ``ceil(per_rank / f)``, so a size between two of them saves nothing
    (``forward_breakpoints(31) == [1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 31]``)."""
    return sorted({-(-per_rank // f) for f in range(1, per_rank + 1)})


def nearest_exact_targets(target_batch_size: int, world_size: int) -> tuple[int, ...]:
    """The multiples of ``world_size`` nearest ``target_batch_size`` (below and above; one if it is one)."""
    below = (target_batch_size // world_size) * world_size
    above = below + world_size
    if below == target_batch_size:
        return (target_batch_size,)
    return (below, above) if below >= world_size else (above,)


def indivisible_target(target_batch_size: int, world_size: int, target_name: str = "target_batch_size",
                       world_name: str = "world_size") -> str | None:
    """None when ``world_size`` ranks share ``target_batch_size`` samples equally; otherwise the one-line reason,
    naming both settings (as the caller spells them: a flag's fix reads "use --flag N") and the nearest exact
    targets. The one divisibility check."""
    if target_batch_size % world_size == 0:
        return None
    options = " or ".join(map(str, nearest_exact_targets(target_batch_size, world_size)))
    fix = f"use {target_name} {options}" if target_name.startswith("--") else f"Set {target_name} to {options}"
    return (f"{target_name}={target_batch_size} is not divisible by {world_name}={world_size}: micro x accumulation x "
            f"world must equal it exactly. {fix}")


# --- memory model -------------------------------------------------------------------------------------
def fit_memory_model(points: Iterable[tuple[int, float]], *, tail: int = 2) -> tuple[float, float]:
    """Least-squares line ``bytes ≈ a + b * micro`` through the ``tail`` largest micro-batch sizes.

    Only the largest sizes are used because the curve bends at small micro-batches (the optimizer step's
    fixed peak dominates there), and a line through the bend under-estimates the slope, which would
    over-predict the largest size that fits.  A repeated size keeps its last value.
    """
    by_micro: dict[int, float] = {}
    for micro, value in points:
        by_micro[int(micro)] = float(value)
    if len(by_micro) < 2:
        raise ValueError(
            f"fit_memory_model needs measurements at two or more micro-batch sizes, got {sorted(by_micro)}"
        )
    chosen = sorted(by_micro.items())[-max(2, tail) :]
    n = len(chosen)
    mean_x = sum(x for x, _ in chosen) / n
    mean_y = sum(y for _, y in chosen) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in chosen)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in chosen)
    b = sxy / sxx
    return mean_y - b * mean_x, b


def predict_bytes(model: tuple[float, float], micro: int) -> float:
    a, b = model
    return a + b * micro


def predict_max_micro(model: tuple[float, float], budget_bytes: float) -> int | None:
    """Largest micro-batch whose predicted memory is <= ``budget_bytes``; None when memory does not grow.

    A hair of tolerance (1e-9 of a step) keeps an exact formula that lands on the budget from being
    floored one below by float rounding.
    """
    a, b = model
    if b <= 0:
        return None
    return math.floor((budget_bytes - a) / b + 1e-9)


# --- the plan -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """``world_size`` ranks, each with a window of ``target_batch_size / world_size`` samples per optimizer step,
    cut into ``gradient_accumulation_steps`` forwards of at most ``micro_batch_size`` samples each:
    ``gradient_accumulation_steps == ceil(window / micro_batch_size)``. When the micro-batch divides the window
    this is transformers' ``micro × accumulation × world == target``; otherwise the forwards are near-equal
    (31 = 7 + 6 + 6 + 6 + 6), which the exact window loss allows."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    target_batch_size: int
    token_budget: int | None = None  # micro_batching="tokens": tokens per forward; micro = the per-rank window
    token_model: dict | None = None  # the probe's cost model: more rows at lengths it measured (token_budget.py)
    step_time: dict | None = None  # a forward's fixed seconds and seconds per padded token: the token cut (token_budget.py)
    engine: str | None = None  # the sharded engine that runs it ("DeepSpeed ZeRO-3"); None: DDP or one process
    levers: dict | None = None  # one record per lever, {"checkpointing": {"layers": 2, "of": 4}} (hf_accum/levers/)
    step_seconds: float | None = None  # the measured time per optimizer step the choice was made on
    eval_batch_size: int | None = None  # per rank, measured at the first evaluation (eval_batch.py); None: as given

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "gradient_accumulation_steps", "world_size", "target_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"inconsistent plan: {name}={value!r} is not a positive integer")
        if self.token_budget is not None and (not isinstance(self.token_budget, int)
                                              or isinstance(self.token_budget, bool) or self.token_budget < 1):
            raise ValueError(f"inconsistent plan: token_budget={self.token_budget!r} is not a positive integer")
        if self.token_model is not None:
            keys = {"lengths", "rows_at", "usable_bytes", "per_token_bytes", "per_token_sq_bytes"}
            if self.token_budget is None or not isinstance(self.token_model, dict) or not keys <= set(self.token_model):
                raise ValueError(f"inconsistent plan: token_model needs a token_budget and the keys {sorted(keys)}")
        if self.step_time is not None:
            wrong = step_model.check(self.step_time)
            if self.token_budget is None or wrong:
                raise ValueError(f"inconsistent plan: step_time={self.step_time!r} needs a token_budget"
                                 + (f" and {wrong}" if wrong else ""))
        for name, record in (self.levers or {}).items():
            check_lever_record(name, record)
        if self.target_batch_size % self.world_size:
            raise ValueError(f"inconsistent plan: target_batch_size={self.target_batch_size} is not a multiple of "
                             f"world_size={self.world_size}")
        window = self.window
        if self.micro_batch_size > window or self.gradient_accumulation_steps != forwards_for(window, self.micro_batch_size):
            raise ValueError(f"inconsistent plan: micro {self.micro_batch_size} × accumulation "
                             f"{self.gradient_accumulation_steps} does not cut a window of {window} samples "
                             f"(accumulation must be ceil({window} / {self.micro_batch_size}))")

    @property
    def checkpointed_layers(self) -> int | None:
        """The decoder layers the tuner chose to recompute (the checkpointing lever's record); None when it did not
        choose (a level the user set is in ``levers`` with ``"pinned": true``)."""
        record = (self.levers or {}).get("checkpointing") or {}
        return None if record.get("pinned") else record.get("layers")

    @property
    def num_layers(self) -> int | None:
        """Of how many (1: a model whose checkpointing is on or off only); None as ``checkpointed_layers``."""
        record = (self.levers or {}).get("checkpointing") or {}
        return None if record.get("pinned") else record.get("of")

    @property
    def window(self) -> int:
        """Samples per rank per optimizer step."""
        return self.target_batch_size // self.world_size

    @property
    def forwards(self) -> int:
        """Forwards per rank per optimizer step (a token budget's depend on the data: 1 loaded window)."""
        return self.gradient_accumulation_steps

    @property
    def even(self) -> bool:
        """The micro-batch divides the window: transformers' own loading can run this plan."""
        return self.micro_batch_size * self.gradient_accumulation_steps == self.window

    def describe(self) -> str:
        """The plan in words, each lever's record as the lever says it (the registry's ``describe``)."""
        on = f" on {self.engine}" if self.engine else ""
        if self.levers:
            from ..levers import get_lever  # lazily: the levers import torch, the plan's arithmetic does not

            # by name: the same line whatever order the records were added or the plan file kept them in
            on += "".join(f"; {get_lever(name).describe(record)}" for name, record in sorted(self.levers.items()))
        on += f"; eval batch {self.eval_batch_size}" if self.eval_batch_size else ""
        if self.token_budget is not None:
            timed = ""
            if self.step_time is not None:  # what a forward costs beyond its tokens sets how many forwards
                timed = f", as many as the least modelled step time ({step_model.describe(self.step_time)})"
            return (f"window {self.micro_batch_size} × world {self.world_size} = {self.target_batch_size}, "
                    f"cut into forwards of at most {self.token_budget} tokens{timed}{on}")
        if not self.even:
            return (f"window {self.window} × world {self.world_size} = {self.target_batch_size}, "
                    f"{self.forwards} forwards of ≤ {self.micro_batch_size} rows{on}")
        return (
            f"micro {self.micro_batch_size} × accumulation {self.gradient_accumulation_steps} "
            f"× world {self.world_size} = {self.target_batch_size}{on}"
        )

    def to_dict(self) -> dict[str, int | str]:
        out = asdict(self)
        for optional in OPTIONAL_FIELDS:
            if out[optional] is None:
                del out[optional]  # plan files of "samples" mode without an engine keep their four fields
        return out


OPTIONAL_FIELDS = ("token_budget", "token_model", "step_time", "engine", "levers", "step_seconds", "eval_batch_size")


def check_lever_record(name: str, record) -> None:
    """What the plan knows of any lever's record (hf_accum/levers/base.py): plain numbers, a layer count ``of`` >= 1,
    and the layers at each level (every other integer) adding up to at most ``of``; or a kernel's record (the
    ``loss_kernel`` lever): its name and what was measured of each kernel. ValueError otherwise."""
    if isinstance(record, dict) and "kernel" in record:
        measured = [v for key in ("seconds", "peak_bytes", "step_seconds", "forwards_per_step", "tokens_per_forward")
                    for v in (record.get(key) or {}).values()]
        if not isinstance(record["kernel"], str) or not all(isinstance(v, (int, float)) and v >= 0 for v in measured):
            raise ValueError(f"inconsistent plan: levers[{name!r}]={record!r} (a kernel's name and its measured "
                             "seconds and peaks, each >= 0)")
        return
    counts = {k: v for k, v in record.items() if k != "of" and isinstance(v, int) and not isinstance(v, bool)} \
        if isinstance(record, dict) else {}
    of = record.get("of") if isinstance(record, dict) else None
    if not (isinstance(of, int) and not isinstance(of, bool) and of >= 1 and counts
            and all(v >= 0 for v in counts.values()) and sum(counts.values()) <= of):
        raise ValueError(f"inconsistent plan: levers[{name!r}]={record!r} (its layers must add up to at most "
                         "'of', each >= 0)")


def plan_batch(target_batch_size: int, world_size: int, max_micro_batch_size: int) -> Plan:
    """The exact plan with the fewest forwards: the per-rank window cut into ``ceil(window / max)`` near-equal
    forwards, ``micro_batch_size`` the largest of them (``ceil(31 / 5) = 7`` for 31 samples where 7 fit).

    ``max_micro_batch_size`` is the largest micro-batch that fits in memory (from the probe), or 0 when
    none does.  Raises ``ValueError`` naming the argument and the fix when no exact plan exists.
    """
    for name, value in (("target_batch_size", target_batch_size), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    problem = indivisible_target(target_batch_size, world_size)
    if problem:
        raise ValueError(f"{problem}, or run on a world size that divides {target_batch_size}.")
    if max_micro_batch_size < 1:
        raise ValueError(
            f"no micro-batch fits in memory (max_micro_batch_size={max_micro_batch_size}), so no plan reaches "
            f"target_batch_size={target_batch_size}. Free memory per sample: enable gradient_checkpointing, "
            "train LoRA adapters instead of all weights, load the base model in 4-bit, shorten the sequence "
            "length, or raise the memory budget."
        )
    per_rank = target_batch_size // world_size
    return plan_for_micro(target_batch_size, world_size, min(max_micro_batch_size, per_rank))


def plan_for_micro(target_batch_size: int, world_size: int, micro: int) -> Plan:
    """The plan cutting each rank's window into ``ceil(window / micro)`` near-equal forwards."""
    per_rank = target_batch_size // world_size
    forwards = forwards_for(per_rank, min(micro, per_rank))
    return Plan(forwards_for(per_rank, forwards), forwards, world_size, target_batch_size)


def choose_fastest(samples_per_second: dict[int, float], per_rank_target: int, max_micro_batch_size: int) -> int:
    """``optimize="throughput"``: the fitting size with the least time per optimizer step, ``ceil(window / m)``
    forwards of ``m / samples_per_second[m]`` seconds each (the largest forward sets the pace).

    Ties go to the larger micro-batch (fewer forwards).
    """
    fitting = [m for m in forward_breakpoints(per_rank_target)
               if m <= max_micro_batch_size and samples_per_second.get(m)]
    if not fitting:
        raise ValueError("choose_fastest: no timed micro-batch size of the per-rank target fits")
    return min(fitting, key=lambda m: (forwards_for(per_rank_target, m) * m / samples_per_second[m], -m))
