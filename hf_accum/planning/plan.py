"""Pure planning: measurements + budget + target -> (micro-batch, accumulation).  Numbers in, numbers out.

Nothing here touches a device.  Three pieces:

* the memory model: peak memory is close to ``a + b * micro`` at realistic lengths; it bends at small
  micro-batches, where the optimizer step (a fixed cost) sets the peak instead of the activations, so
  the line is fitted through the measured points nearest the budget, not through all of them;
* :class:`MicroBatchSearch`, the search policy as a small state machine (``propose`` / ``record``), so the
  probe, the tests and the benchmark all drive the very same decisions;
* :func:`plan_batch`: ``world`` ranks × a per-rank window of ``target / world`` samples, cut into the fewest
  forwards of at most the largest micro-batch that fits (near-equal; no divisor constraint, since the loss is
  normalized over the whole window), or a ``ValueError`` that says what to set instead.  The effective batch
  is never changed silently.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

# The search stops once the largest size verified to fit is at least this fraction of the best estimate
# of the largest size that fits (the goal): the last few percent would cost one more trial each.
GOAL_FRACTION = 0.95


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


def forwards_for(units: int, max_units: int) -> int:
    """Forwards needed for ``units`` samples at most ``max_units`` per forward: ``ceil(units / max_units)``."""
    return -(-units // max_units)


def forward_breakpoints(per_rank: int) -> list[int]:
    """The micro-batch sizes a plan can use for a per-rank window of ``per_rank`` samples: the smallest
    ``m`` reaching each forward count, ``ceil(per_rank / f)``, so a size between two of them saves nothing
    (``forward_breakpoints(31) == [1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 31]``)."""
    return sorted({-(-per_rank // f) for f in range(1, per_rank + 1)})


def near_equal_sizes(units: int, forwards: int) -> list[int]:
    """``units`` cut into ``forwards`` sizes differing by at most one, the smaller ones first (the window's
    longest rows go first, so they get the smaller forwards): ``near_equal_sizes(31, 5) == [6, 6, 6, 6, 7]``."""
    forwards = max(1, min(forwards, units))
    small, extra = divmod(units, forwards)
    return [small] * (forwards - extra) + [small + 1] * extra


def near_equal_groups(lengths: Sequence[int], max_units: int, groups: int | None = None) -> list[list[int]]:
    """Indices of padded rows cut into ``ceil(n / max_units)`` forwards (at least ``groups``) of near-equal counts,
    longest rows together, the longest in the smaller forwards; each group's indices in their original order."""
    total = len(lengths)
    sizes = near_equal_sizes(total, max(forwards_for(total, max_units), groups or 1))
    order = sorted(range(total), key=lambda i: -lengths[i])  # stable: equal lengths keep their order
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [sorted(order[lo:hi]) for lo, hi in zip(starts[:-1], starts[1:])]


def nearest_exact_targets(target_batch_size: int, world_size: int) -> tuple[int, ...]:
    """The multiples of ``world_size`` nearest ``target_batch_size`` (below and above; one if it is one)."""
    below = (target_batch_size // world_size) * world_size
    above = below + world_size
    if below == target_batch_size:
        return (target_batch_size,)
    return (below, above) if below >= world_size else (above,)


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
    engine: str | None = None  # the sharded engine that runs it ("DeepSpeed ZeRO-3"); None: DDP or one process
    checkpointed_layers: int | None = None  # decoder layers recomputing in the backward, chosen by the tuner (levers.py)
    num_layers: int | None = None  # of how many (1: a model whose checkpointing is on or off only)
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
        if self.checkpointed_layers is not None and not (
                isinstance(self.checkpointed_layers, int) and isinstance(self.num_layers, int)
                and 0 <= self.checkpointed_layers <= self.num_layers and self.num_layers >= 1):
            raise ValueError(f"inconsistent plan: checkpointed_layers={self.checkpointed_layers!r} of "
                             f"num_layers={self.num_layers!r}")
        if self.target_batch_size % self.world_size:
            raise ValueError(f"inconsistent plan: target_batch_size={self.target_batch_size} is not a multiple of "
                             f"world_size={self.world_size}")
        window = self.window
        if self.micro_batch_size > window or self.gradient_accumulation_steps != forwards_for(window, self.micro_batch_size):
            raise ValueError(f"inconsistent plan: micro {self.micro_batch_size} × accumulation "
                             f"{self.gradient_accumulation_steps} does not cut a window of {window} samples "
                             f"(accumulation must be ceil({window} / {self.micro_batch_size}))")

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
        on = f" on {self.engine}" if self.engine else ""
        if self.checkpointed_layers is not None:
            on += f"; checkpointing {self.checkpointed_layers} of {self.num_layers} layers"
        on += f"; eval batch {self.eval_batch_size}" if self.eval_batch_size else ""
        if self.token_budget is not None:
            return (f"window {self.micro_batch_size} × world {self.world_size} = {self.target_batch_size}, "
                    f"cut into forwards of at most {self.token_budget} tokens{on}")
        if not self.even:
            return (f"window {self.window} × world {self.world_size} = {self.target_batch_size}, "
                    f"{self.forwards} forwards of ≤ {self.micro_batch_size} rows{on}")
        return (
            f"micro {self.micro_batch_size} × accumulation {self.gradient_accumulation_steps} "
            f"× world {self.world_size} = {self.target_batch_size}{on}"
        )

    def to_dict(self) -> dict[str, int | str]:
        out = asdict(self)
        for optional in ("token_budget", "token_model", "engine", "checkpointed_layers", "num_layers", "step_seconds",
                         "eval_batch_size"):
            if out[optional] is None:
                del out[optional]  # plan files of "samples" mode without an engine keep their four fields
        return out


def plan_batch(target_batch_size: int, world_size: int, max_micro_batch_size: int) -> Plan:
    """The exact plan with the fewest forwards: the per-rank window cut into ``ceil(window / max)`` near-equal
    forwards, ``micro_batch_size`` the largest of them (``ceil(31 / 5) = 7`` for 31 samples where 7 fit).

    ``max_micro_batch_size`` is the largest micro-batch that fits in memory (from the probe), or 0 when
    none does.  Raises ``ValueError`` naming the argument and the fix when no exact plan exists.
    """
    for name, value in (("target_batch_size", target_batch_size), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if target_batch_size % world_size:
        options = " or ".join(str(t) for t in nearest_exact_targets(target_batch_size, world_size))
        raise ValueError(
            f"target_batch_size={target_batch_size} is not divisible by world_size={world_size}: "
            f"micro × accumulation × world must equal the target exactly. Set target_batch_size to {options}, "
            f"or run on a world size that divides {target_batch_size}."
        )
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


# --- the search ------------------------------------------------------------------------------------------
@dataclass
class Observation:
    """One trial as the search sees it.

    ``charged_bytes`` is what the budget is compared with (reserved memory when the meter knows it,
    since that is what the allocator asks the device for; else the peak); None when the step ran out of
    memory or was not run.  ``baseline_bytes`` is the memory held before the step (weights, optimizer
    state), ``rounding_bytes`` the meter's bound on what its allocator may add beyond what it reports.
    """

    micro: int
    charged_bytes: float | None
    fits: bool
    baseline_bytes: float | None = None
    rounding_bytes: float = 0.0
    predicted_bytes: float | None = None  # what the line said before the trial, when it said anything


@dataclass
class MicroBatchSearch:
    """Find the largest micro-batch whose memory is within ``budget_bytes`` in few trials.

    Policy (``propose`` returns the next size, ``record`` feeds the result back, None means done):

    1. measure micro-batch 1 (the warm-up step before it is the caller's and not a trial);
    2. jump to a size that provably fits if memory is linear with a non-negative intercept above the
       baseline: then ``peak(m) - baseline <= m * (peak(1) - baseline)``, so
       ``m = (budget - baseline) / (peak(1) - baseline)`` fits;
    3. fit a line through the two measured points nearest the budget and jump to the largest size it
       predicts under ``budget - margin`` (see :meth:`margin_bytes`), but at least to the goal
       (``GOAL_FRACTION`` of the prediction); when a point over the budget was measured (CPU meters
       report one instead of failing) the line is a chord across the budget, and the estimate is the
       midpoint of the chord's and the fitting points' predictions (:meth:`estimate`);
    4. if a jump runs out of memory although the line said it fits, the line is wrong above the last
       fitting size: bisect between the largest fit and the smallest failure, then fit
       again; if the line is flat (both points on the optimizer-step plateau), double instead;
    5. stop when the largest fitting size is within the goal of the estimate *and* no size in
       ``must_resolve`` (the divisors of the per-rank target, the sizes the plan can use) lies between
       the largest fit and the estimate, so the next divisor is known to exceed the budget, measured or
       predicted (:meth:`next_over`).
    """

    budget_bytes: float
    max_micro_batch: int
    must_resolve: Sequence[int] = ()
    goal: float = GOAL_FRACTION
    observations: list[Observation] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {self.budget_bytes}")
        if self.max_micro_batch < 1:
            raise ValueError(f"max_micro_batch must be >= 1, got {self.max_micro_batch}")
        self.must_resolve = sorted({int(d) for d in self.must_resolve if 1 <= d <= self.max_micro_batch})
        self._pending_prediction: tuple[int, float] | None = None

    # -- state ---------------------------------------------------------------------------------------
    @property
    def largest_fit(self) -> int:
        """Largest size measured to fit, 0 when none has."""
        return max((o.micro for o in self.observations if o.fits), default=0)

    @property
    def smallest_failure(self) -> int:
        """Smallest size known not to fit (measured over budget, out of memory, or refused); else cap + 1."""
        return min((o.micro for o in self.observations if not o.fits), default=self.max_micro_batch + 1)

    def _measured(self) -> dict[int, float]:
        return {o.micro: o.charged_bytes for o in self.observations if o.charged_bytes is not None}

    def line(self) -> tuple[float, float] | None:
        """The memory model from the two measured points nearest the budget, None with fewer than two.

        Nearest means: the largest fitting size plus the smallest measured size above it (an interpolation
        across the budget) when one was measured, else the two largest measured sizes below it.
        """
        measured = self._measured()
        if len(measured) < 2:
            return None
        lo = self.largest_fit
        above = sorted(m for m in measured if m > lo)
        below = sorted(m for m in measured if m <= lo)
        chosen = below[-1:] + above[:1] if above and below else sorted(measured)[-2:]
        if len(chosen) < 2:
            chosen = sorted(measured)[-2:]
        return fit_memory_model([(m, measured[m]) for m in chosen], tail=2)

    def _line_below(self) -> tuple[float, float] | None:
        """The line through the two largest sizes measured to fit, None with fewer than two."""
        fitting = sorted((o.micro, o.charged_bytes) for o in self.observations if o.fits)
        if len({m for m, _ in fitting}) < 2:
            return None
        return fit_memory_model(fitting, tail=2)

    def predict(self, micro: int) -> float | None:
        """Predicted charged bytes at ``micro``; None without a line."""
        model = self.line()
        return None if model is None else predict_bytes(model, micro)

    def last_error_bytes(self) -> float:
        """How far the latest checked prediction missed: measured minus predicted (0 before any).

        The latest, not the worst: each line is fitted closer to the budget than the one before, so an
        early line's miss (through the optimizer-step plateau, across an allocator step) says little
        about the current one.
        """
        for o in reversed(self.observations):
            if o.charged_bytes is not None and o.predicted_bytes is not None:
                return o.charged_bytes - o.predicted_bytes
        return 0.0

    def margin_bytes(self) -> float:
        """Bytes kept free under the budget when aiming a jump; every term is observed, none is a guess.

        * allocator rounding: a meter reports what was requested (CPU) or what was reserved so far
          (CUDA); the allocator may round the next size up by up to ``rounding_bytes`` (CUDA: one new
          20 MiB segment, the caching allocator's ``kLargeBuffer``; CPU: one page per block live at the
          peak, glibc's mmap rounding), which a line through earlier points cannot see;
        * model error: how much the latest measured point exceeded what the line predicted for it
          before it ran (fragmentation growth, the curve bending), in this very probe.
        A jump aimed under ``budget - margin`` lands inside the budget whenever the next point deviates
        from the line no more than the last one did and the allocator rounds up no more than its bound.
        Rounding only ever adds, so the optimistic side of the estimate (:meth:`propose`, step 3) uses
        the model error alone.
        """
        rounding = max((o.rounding_bytes for o in self.observations), default=0.0)
        return max(rounding, self.last_error_bytes(), 0.0)

    def estimate(self, slack_bytes: float = 0.0) -> int:
        """Estimate of the largest fitting size: the line's prediction for ``budget + slack_bytes``,
        bounded by known failures.  With ``slack_bytes = |last_error_bytes()|`` it is the optimistic end
        of what the observed error allows."""
        hi = self.smallest_failure
        model = self.line()
        if model is None:
            return hi - 1
        predicted = predict_max_micro(model, self.budget_bytes + slack_bytes)
        if predicted is None or predicted >= hi:  # flat, or contradicted by a failure: trust measurements
            return hi - 1
        below = self._line_below()
        if below is not None and below != model:
            # The line is a chord across the budget.  On a curved memory curve the chord and the line
            # through the two largest fitting points err to opposite sides (convex: the chord predicts too
            # few samples, the extrapolation too many), so the truth lies between them; the midpoint keeps
            # a far over-budget point from making the search crawl up in steps of one.
            extrapolated = predict_max_micro(below, self.budget_bytes + slack_bytes)
            extrapolated = hi - 1 if extrapolated is None else extrapolated  # flat below: no bound from it
            predicted = (predicted + min(max(extrapolated, predicted), hi - 1)) // 2
        return predicted

    def _line_contradicted(self) -> bool:
        """A size failed that the line says fits (only an out-of-memory failure, which has no value, can)."""
        hi = self.smallest_failure
        if hi > self.max_micro_batch:
            return False
        model = self.line()
        predicted = None if model is None else predict_max_micro(model, self.budget_bytes)
        return predicted is None or predicted >= hi

    def next_over(self) -> tuple[int | None, str]:
        """The smallest ``must_resolve`` size above the largest fit and how it is known not to fit.

        Returns ``(size, "measured")`` when it, or a smaller size, was run (or refused) and did not fit;
        ``(size, "predicted")`` when the line puts it over the budget; ``(None, "cap")`` when no candidate
        is left under the cap; ``(size, "untried")`` when the search stopped within the goal below a size
        it did not rule out (only without ``must_resolve``, whose sizes the search always resolves).
        Without ``must_resolve`` the candidates are all sizes.
        """
        lo = self.largest_fit
        pool = self.must_resolve or range(1, self.max_micro_batch + 1)
        candidates = [d for d in pool if d > lo]
        if not candidates:
            return None, "cap"
        size = candidates[0]
        if size >= self.smallest_failure:
            return size, "measured"
        predicted = self.predict(size)
        if predicted is not None and predicted > self.budget_bytes:
            return size, "predicted"
        # Only without ``must_resolve``: the search stopped within the goal without ruling this size out.
        return size, "untried"

    # -- policy --------------------------------------------------------------------------------------
    def propose(self) -> int | None:
        """The next micro-batch size to measure, or None when the search is done."""
        if not self.observations:
            return 1
        lo, hi = self.largest_fit, self.smallest_failure
        if lo == 0 or lo + 1 >= hi:  # nothing fits at 1, or the answer is bracketed exactly
            return None
        model = self.line()
        if self._line_contradicted():  # step 4: no trustworthy line above lo; bisect the bracket
            est = hi - 1
            if lo >= self.goal * est - 1e-9 and self._unresolved_divisor(lo, est) is None:
                return None
            return self._remember((lo + hi) // 2)
        if model is None:  # step 2
            return self._remember(min(hi - 1, max(lo + 1, self._safe_jump(lo))))
        if model[1] <= 0:  # flat: both points sit on the optimizer-step plateau; the line knows nothing yet
            return self._remember(min(hi - 1, max(2 * lo, self._safe_jump(lo))))
        # step 3.  The goal is measured against the optimistic estimate (the line plus its last miss), so
        # an estimate that is low by that miss still leaves the result within the goal of the truth.  The
        # jump itself goes no further than the line's own prediction: beyond it is a gamble, taken only
        # when the sizes the line vouches for are verified and the goal is still not met.
        central = self.estimate()
        est = self.estimate(abs(self.last_error_bytes()))
        if est <= lo:
            return None
        aim = predict_max_micro(model, self.budget_bytes - self.margin_bytes())
        aim = est if aim is None else aim
        need = math.ceil(self.goal * est - 1e-9)  # the tolerance keeps 0.95 * 20 from rounding up to 20
        proposal = max(aim, min(need, central)) if lo < need else lo
        top_divisor = self._unresolved_divisor(lo, est)
        if top_divisor is not None and (top_divisor <= central or proposal <= lo):
            proposal = max(proposal, top_divisor)
        if proposal <= lo < need:
            proposal = need
        proposal = min(proposal, hi - 1)
        return None if proposal <= lo else self._remember(proposal)

    def record(
        self,
        micro: int,
        charged_bytes: float | None,
        *,
        baseline_bytes: float | None = None,
        rounding_bytes: float = 0.0,
        fits: bool | None = None,
    ) -> Observation:
        """Feed back a trial.  ``charged_bytes=None`` means out of memory (or refused as unsafe).

        ``fits`` defaults to ``charged_bytes <= budget``; pass False to record a size that was refused.
        """
        if fits is None:
            fits = charged_bytes is not None and charged_bytes <= self.budget_bytes
        predicted = None
        if self._pending_prediction is not None and self._pending_prediction[0] == micro:
            predicted = self._pending_prediction[1]
        self._pending_prediction = None
        obs = Observation(micro, charged_bytes, fits, baseline_bytes, rounding_bytes, predicted)
        self.observations.append(obs)
        return obs

    # -- helpers -------------------------------------------------------------------------------------
    def _safe_jump(self, lo: int) -> int:
        """Step 2: the size that fits when memory above the baseline grows at most linearly from 0."""
        first = next(o for o in self.observations if o.micro == lo and o.charged_bytes is not None)
        base = first.baseline_bytes or 0.0
        per_sample_upper = (first.charged_bytes - base) / lo
        if per_sample_upper <= 0:
            return self.max_micro_batch
        return math.floor(lo * (self.budget_bytes - base) / (first.charged_bytes - base) + 1e-9)

    def _unresolved_divisor(self, lo: int, est: int) -> int | None:
        """Largest plan-usable size in (lo, est]: the plan would change if it fits, so it must be tried."""
        inside = [d for d in self.must_resolve if lo < d <= est]
        return inside[-1] if inside else None

    def _remember(self, micro: int) -> int:
        predicted = self.predict(micro)
        self._pending_prediction = None if predicted is None else (micro, predicted)
        return micro
