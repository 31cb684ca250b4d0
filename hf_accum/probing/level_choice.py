"""Pure choice of the checkpointing level: measured levels in, (rows per forward, checkpointed layers) out.

Nothing here touches a device. The probe measures real steps at a few levels k (k of the model's L decoder layers
recompute in the backward; an on/off model has L = 1): at each, the largest micro-batch that fits, the memory line
``bytes ≈ a + b·micro`` through the points nearest the budget, and the step-time line ``seconds ≈ c + s·micro``.
Between measured levels both lines are interpolated linearly in k: each checkpointed layer frees its activations
(b falls) and adds one forward of that layer to the backward (s grows). hf_accum checkpoints the *first* k layers,
whose recompute runs after the later layers' activations are freed, so the full level's extra recompute buffer is
spread over the interpolation: the interpolated memory over-states a partial level's, never under-states it.

The time of one optimizer step at (m, k) is ``ceil(per_rank / m)`` forwards of ``time(rows, k)``, rows the
near-equal share of the window (``ceil(per_rank / forwards)``). The fastest predicted pair within the budget is
proposed; the caller verifies it by a real step unless a measured fitting point at that level already covers it
(same k, at least as many rows), records the outcome, and a failure backs off to the next best
(:meth:`CheckpointChooser.propose` / :meth:`CheckpointChooser.record`, as `probing.search.MicroBatchSearch`). A measured
level's own largest fit is always a verified fallback, so the search ends on a point measured to fit, or on None
only when no level fits micro-batch 1 (with every layer checkpointed: nothing is left to free).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

Line = tuple[float, float]  # (intercept, slope) in micro


@dataclass(frozen=True)
class Level:
    """What the probe measured with ``k`` layers checkpointed.

    ``largest_fit``: the largest micro-batch measured to fit (0: none); ``smallest_failure``: the smallest one known
    not to (None: none failed); ``memory``: bytes ≈ a + b·micro near the budget (None with fewer than two points);
    ``time``: seconds of one step ≈ c + s·micro (None: not timed)."""

    k: int
    largest_fit: int
    smallest_failure: int | None = None
    memory: Line | None = None
    time: Line | None = None


@dataclass(frozen=True)
class Choice:
    """One (rows per forward, k) pair: ``forwards`` per optimizer step per rank; ``verified``: a measured step at
    this k with at least ``micro`` rows fitted (no extra step needed)."""

    micro: int
    k: int
    forwards: int
    predicted_bytes: float | None
    predicted_seconds: float | None
    verified: bool


def fit_time_line(points: list[tuple[int, float]]) -> Line | None:
    """Least-squares ``seconds ≈ c + s·micro`` through timed steps (a repeated size keeps its fastest time); one
    size: proportional (c = 0); none: None. A negative intercept or slope from noise is clamped to 0."""
    best: dict[int, float] = {}
    for micro, seconds in points:
        if seconds is not None and seconds > 0:
            best[int(micro)] = min(float(seconds), best.get(int(micro), math.inf))
    if not best:
        return None
    if len(best) == 1:
        (micro, seconds), = best.items()
        return 0.0, seconds / micro
    n = len(best)
    mean_x = sum(best) / n
    mean_y = sum(best.values()) / n
    sxx = sum((x - mean_x) ** 2 for x in best)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in best.items()) / sxx
    if slope <= 0:
        return mean_y, 0.0
    intercept = mean_y - slope * mean_x
    if intercept < 0:  # through the origin instead
        return 0.0, sum(x * y for x, y in best.items()) / sum(x * x for x in best)
    return intercept, slope


def scale_line(line: Line, factor: float) -> Line:
    """``line`` times ``factor``: instrumented steps give the shape, one plain step the ratio to the real time."""
    return line[0] * factor, line[1] * factor


@dataclass
class CheckpointChooser:
    """The fastest (rows, k) for ``per_rank`` samples per optimizer step within ``budget_bytes``.

    ``levels``: the measured levels (k in 0..num_layers); ``cap``: the most rows one forward may hold;
    ``margin_bytes``: kept free under the budget when predicting an unmeasured level; ``tie_fraction``: predicted
    times this close to the fastest count as equal, and the fewest checkpointed layers is chosen among them."""

    per_rank: int
    num_layers: int
    budget_bytes: float
    levels: list[Level]
    cap: int | None = None
    margin_bytes: float = 0.0
    tie_fraction: float = 0.03
    failed: dict[int, int] = field(default_factory=dict)  # k -> smallest rows a verify step found not to fit
    verified: dict[int, int] = field(default_factory=dict)  # k -> largest rows a verify step found to fit
    accepted: Choice | None = None

    def __post_init__(self) -> None:
        if self.per_rank < 1 or self.num_layers < 1:
            raise ValueError(f"per_rank={self.per_rank} and num_layers={self.num_layers} must be >= 1")
        if not self.levels:
            raise ValueError("CheckpointChooser needs at least one measured level")
        for level in self.levels:
            if not 0 <= level.k <= self.num_layers:
                raise ValueError(f"level k={level.k} is outside 0..{self.num_layers}")
        self.levels = sorted(self.levels, key=lambda lv: lv.k)
        self.cap = min(self.cap or self.per_rank, self.per_rank)

    # -- the models ----------------------------------------------------------------------------------------------
    def _bracket(self, k: int) -> tuple[Level, Level] | None:
        below = [lv for lv in self.levels if lv.k <= k]
        above = [lv for lv in self.levels if lv.k >= k]
        if not below or not above:
            return None
        return below[-1], above[0]

    @staticmethod
    def _mix(lo: Line | None, hi: Line | None, t: float) -> Line | None:
        if lo is None or hi is None:
            return None
        return lo[0] + (hi[0] - lo[0]) * t, lo[1] + (hi[1] - lo[1]) * t

    def _lines(self, k: int) -> tuple[Line | None, Line | None]:
        bracket = self._bracket(k)
        if bracket is None:
            return None, None
        lo, hi = bracket
        if lo.k == hi.k:
            return lo.memory, lo.time
        t = (k - lo.k) / (hi.k - lo.k)
        return self._mix(lo.memory, hi.memory, t), self._mix(lo.time, hi.time, t)

    def predict_bytes(self, micro: int, k: int) -> float | None:
        memory, _ = self._lines(k)
        return None if memory is None else memory[0] + memory[1] * micro

    def predict_seconds(self, micro: int, k: int) -> float | None:
        """Seconds per optimizer step: ceil(per_rank / micro) forwards of the near-equal share of the window."""
        _, time = self._lines(k)
        if time is None:
            return None
        forwards = math.ceil(self.per_rank / micro)
        rows = math.ceil(self.per_rank / forwards)
        return forwards * (time[0] + time[1] * rows)

    def max_micro(self, k: int) -> int:
        """The most rows a forward may hold at level k: measured at a measured level, else predicted from the
        interpolated line within the bracketing levels' measurements; 0 when none."""
        measured = {lv.k: lv for lv in self.levels}
        upper = self.cap
        # memory falls as k grows: a failure at k or any larger k bounds k; a fit at k or any smaller k is a floor
        for lv in self.levels:
            if lv.k >= k and lv.smallest_failure is not None:
                upper = min(upper, lv.smallest_failure - 1)
        for fk, rows in self.failed.items():
            if fk >= k:
                upper = min(upper, rows - 1)
        floor = max([lv.largest_fit for lv in self.levels if lv.k <= k]
                    + [rows for vk, rows in self.verified.items() if vk <= k] + [0])
        if k in measured:
            return max(0, min(max(floor, measured[k].largest_fit), upper))
        memory, _ = self._lines(k)
        predicted = floor
        if memory is not None and memory[1] > 0:
            predicted = max(floor, math.floor((self.budget_bytes - self.margin_bytes - memory[0]) / memory[1] + 1e-9))
        return max(0, min(predicted, upper))

    def is_verified(self, micro: int, k: int) -> bool:
        """Whether a step measured to fit covers (micro, k): one at this k or a smaller one (memory falls as k
        grows) with at least ``micro`` rows."""
        fits = [lv.largest_fit for lv in self.levels if lv.k <= k]
        fits += [rows for vk, rows in self.verified.items() if vk <= k]
        return micro <= max(fits, default=0)

    # -- the policy ----------------------------------------------------------------------------------------------
    def candidates(self) -> list[Choice]:
        """For each number of forwards reachable, the smallest k reaching it, fastest first (ties: fewer layers
        recomputed, then fewer forwards). Without time lines: fewest forwards, then fewest layers."""
        best_by_forwards: dict[int, Choice] = {}
        for k in range(self.num_layers + 1):
            micro = self.max_micro(k)
            if micro < 1:
                continue
            forwards = math.ceil(self.per_rank / micro)
            if forwards in best_by_forwards:
                continue  # a smaller k already reaches this many forwards: recompute only adds time
            rows = math.ceil(self.per_rank / forwards)
            best_by_forwards[forwards] = Choice(rows, k, forwards, self.predict_bytes(rows, k),
                                                self.predict_seconds(rows, k), self.is_verified(rows, k))
        choices = list(best_by_forwards.values())
        timed = all(c.predicted_seconds is not None for c in choices)
        if not timed:
            return sorted(choices, key=lambda c: (c.forwards, c.k))
        choices.sort(key=lambda c: (c.predicted_seconds, c.k, c.forwards))
        if choices:
            # predictions within `tie_fraction` of the fastest are a tie (step times are measured, noise included):
            # the fewest recomputed layers wins it, so noise does not flip the choice to checkpointing
            fastest = choices[0].predicted_seconds
            tied = [c for c in choices if c.predicted_seconds <= fastest * (1 + self.tie_fraction)]
            first = min(tied, key=lambda c: (c.k, c.forwards))
            choices.remove(first)
            choices.insert(0, first)
        return choices

    def propose(self) -> Choice | None:
        """The best candidate: accepted at once when a measurement already covers it (``accepted`` is set), else
        to be verified by a real step and fed to :meth:`record`. None when nothing fits at any level."""
        choices = self.candidates()
        if not choices:
            return None
        best = choices[0]
        if best.verified:
            self.accepted = best
        return best

    def best_verified(self) -> Choice | None:
        """The best candidate a measurement already covers (the fallback when verifying steps keep failing)."""
        return next((c for c in self.candidates() if c.verified), None)

    def record(self, choice: Choice, fits: bool) -> None:
        """The verifying step's outcome: a fit accepts ``choice``; a failure bounds its level and the ones below."""
        if fits:
            self.verified[choice.k] = max(self.verified.get(choice.k, 0), choice.micro)
            self.accepted = Choice(choice.micro, choice.k, choice.forwards, choice.predicted_bytes,
                                   choice.predicted_seconds, True)
        else:
            self.failed[choice.k] = min(self.failed.get(choice.k, choice.micro), choice.micro)
