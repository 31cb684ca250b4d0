"""Pure search for the largest micro-batch that fits a memory budget, in few trials: `MicroBatchSearch`, the policy
as a small state machine (``propose`` / ``record``), so the probe, the tests and the benchmark all drive the very
same decisions. Numbers in, numbers out; nothing here touches a device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .plan import fit_memory_model, predict_bytes, predict_max_micro

# The search stops once the largest size verified to fit is at least this fraction of the best estimate
# of the largest size that fits (the goal): the last few percent would cost one more trial each.
GOAL_FRACTION = 0.95


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

    ``seed``: an estimate of the largest fitting size (`hf_accum.probing.paper`, on fake tensors) to start from instead
    of step 1: measure it, then the size above it (fits and the next does not: the answer, in two trials); if it
    does not fit, the size below it; when neither brackets the boundary, steps 1-5 go on from what was measured.
    Only measurements decide: a wrong seed costs trials, never the answer.
    """

    budget_bytes: float
    max_micro_batch: int
    must_resolve: Sequence[int] = ()
    goal: float = GOAL_FRACTION
    observations: list[Observation] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {self.budget_bytes}")
        if self.max_micro_batch < 1:
            raise ValueError(f"max_micro_batch must be >= 1, got {self.max_micro_batch}")
        self.must_resolve = sorted({int(d) for d in self.must_resolve if 1 <= d <= self.max_micro_batch})
        if self.seed is not None:
            self.seed = min(max(int(self.seed), 1), self.max_micro_batch)
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
        seeded = self._seeded()
        if seeded is not None:
            return self._remember(seeded)
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
    def _seeded(self) -> int | None:
        """The seeded start (see the class docstring): the seed, then the size above it if it fitted, else the size
        below; then micro-batch 1 if nothing has fitted yet. None once the seed's neighbourhood is measured."""
        if self.seed is None:
            return None
        tried = {o.micro for o in self.observations}
        fits = {o.micro: o.fits for o in self.observations}
        s = self.seed
        if s not in tried:
            return s
        if fits[s]:
            return s + 1 if s + 1 <= self.max_micro_batch and s + 1 not in tried else None
        if s > 1 and s - 1 not in tried:
            return s - 1
        if self.largest_fit == 0 and 1 not in tried:
            return 1
        return None

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
