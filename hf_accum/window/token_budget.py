"""Cutting a window under a token budget (``micro_batching="tokens"``): pure functions of lengths.

A forward of padded rows costs ``rows x longest`` tokens; the budget is the most tokens one forward may hold
(measured by the probe at the worst-case length and checked at a short one). Rows are sorted by length, so each
chunk pads only to its own longest row, and cut into contiguous groups:

1. the fewest forwards: greedily from the longest row, each group as large as the budget allows (optimal: the
   group holding the longest remaining row can hold at most ``budget // longest`` rows, and taking the next
   longest ones leaves the shortest, cheapest rows for later groups);
2. among partitions with that many groups (or with ``groups`` forced higher, so that every rank runs the same
   number of forwards), the one with the least padding: a small dynamic programme over the sorted lengths
   (contiguous groups of the sorted rows are optimal: tests/window/test_token_budget.py checks it by brute force);
3. how many forwards, from the fewest up to as many as equal micro-batches sized for the window's longest row would
   take ("samples" mode's count): the one whose modelled step time is least (`step_time`, `fit_step_time` of the
   probe's timed steps, stored in the plan, so a stored or resumed plan cuts the same window the same way); fewer
   forwards on a tie. The probe times one forward of its largest fit, half of it, a quarter, ... down to one row at
   each length it measured, and the optimizer's step alone, so a forward of ``rows`` rows padded to ``length``
   costs what was measured at that size less the optimizer's step (which a window pays once), interpolated
   between the timed sizes and lengths (`step_time.Forwards`). No single fixed cost per forward describes a forward:
   cutting a large forward in two costs about nothing where smaller forwards run faster per token, and each forward
   more of a few rows costs milliseconds (benchmarks/bench_token_budget.py part 4). Every such cut is exact: the
   loss is normalized over the whole window. A plan without step times (``auto_tune=False``, or a plan file stored
   before them) keeps the earlier rule: one more forward while the window's padded tokens exceed
   ``PADDING_TARGET`` (1.10) times its real tokens. A plan file stored with the earlier step-time model (a fixed
   cost per forward plus a cost per padded token: ``token_seconds``) still cuts by it.

Padding-free rows cost their total tokens (no padding): consecutive sequences are packed greedily.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .step_time import Forwards, fit_step_time, modelled_seconds, packed_seconds, token_seconds

__all__ = ["PADDING_TARGET", "TokenBudget", "TooLongForBudget", "candidate_cuts", "cost_model", "fewest_groups",
           "fit_step_time", "modelled_seconds", "packed_seconds", "padded_tokens", "partition_packed",
           "partition_padded", "plan_budget", "predicted_peak", "row_cost", "step_time_rule", "token_seconds"]

PADDING_TARGET = 1.10  # a plan without step times: padded / real tokens above which one more forward is taken (step 3)


def cost_model(base: float, per_row: dict[int, float]) -> dict[str, float]:
    """What a step's peak costs, from the probe's measured lines ``peak ≈ base + rows x per_row[length]`` at each
    measured padded length: ``peak ≈ base + rows x (per_row + per_token x length + per_token_sq x length²)``. The
    per-token term holds activations; the quadratic one eager attention's score matrices, or the masked scores
    SDPA builds for a padding mask (about 0 with flash attention); the per-row one what a row costs whatever its
    length. Three measured lengths determine the three terms; with two, the per-row term is taken as 0 (between the
    two lengths that over-estimates a row's cost by ``per_row (length - short)(long - length) / (short x long)``:
    on the safe side); with one, everything is per token."""
    points = sorted(per_row.items())
    if len(points) >= 3:
        (x0, y0), (x1, y1), (x2, y2) = points[0], points[len(points) // 2], points[-1]
        # the quadratic through the three slopes (Newton's divided differences)
        d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
        quad = (d12 - d01) / (x2 - x0)
        linear = d01 - quad * (x0 + x1)
        constant = y0 - linear * x0 - quad * x0 * x0
    elif len(points) == 2:
        (short, s_short), (long, s_long) = points
        quad = (s_long / long - s_short / short) / (long - short)
        constant, linear = 0.0, s_short / short - quad * short
    else:
        (length, slope), = points
        constant, linear, quad = 0.0, slope / length, 0.0
    return {"base_bytes": float(base), "per_row_bytes": constant, "per_token_bytes": linear,
            "per_token_sq_bytes": quad, "lengths": [x for x, _ in points]}


def row_cost(model: dict[str, float], length: int) -> float:
    return model.get("per_row_bytes", 0.0) + model["per_token_bytes"] * length + model["per_token_sq_bytes"] * length ** 2


def predicted_peak(model: dict[str, float], rows: int, length: int) -> float:
    return model["base_bytes"] + rows * row_cost(model, length)


@dataclass(frozen=True)
class TokenBudget:
    """What one forward of padded rows may hold: ``rows(length)`` rows padded to ``length``.

    ``tokens`` holds at every length (the smallest of the token capacities measured at the probed lengths, or a
    given ``max_tokens_per_forward``): ``rows = tokens // length``. With the probe's ``model`` (`cost_model` plus
    ``usable_bytes``: the budget less the base and less the model's worst under-prediction of a measured step, and
    ``rows_at``: the rows measured to fit at each probed length), a length between the shortest and the longest
    probed one may hold more rows, as many as the model predicts fit; outside them it is not used (see
    `cost_model` for why the model errs on the safe side between measured lengths)."""

    tokens: int
    model: dict | None = None
    padding_target: float | None = PADDING_TARGET  # read without step times; None: the fewest forwards, always
    step_time: dict | None = None  # `fit_step_time`: the number of forwards by the least modelled step time
    _forwards: Forwards | None = field(default=None, init=False, compare=False, repr=False)

    def forwards(self) -> Forwards:
        """``step_time`` read (`step_time.Forwards`), once per budget: every window of a run is cut by it."""
        if self._forwards is None:
            object.__setattr__(self, "_forwards", Forwards(self.step_time))
        return self._forwards

    def rows(self, length: int) -> int:
        floor = self.tokens // length
        m = self.model
        if not m or not m["lengths"][0] <= length <= m["lengths"][-1]:
            return floor
        measured = m["rows_at"].get(str(length))  # JSON keys: the plan file stores and reads it so
        if measured is not None:
            return max(floor, measured)
        per_row = row_cost(m, length)
        return max(floor, int(m["usable_bytes"] // per_row)) if per_row > 0 else floor

    def scaled(self, factor: float) -> TokenBudget:
        """After an OOM: every capacity times ``factor``."""
        model = None
        if self.model:
            model = {**self.model, "usable_bytes": self.model["usable_bytes"] * factor,
                     "rows_at": {k: int(v * factor) for k, v in self.model["rows_at"].items()}}
        return replace(self, tokens=int(self.tokens * factor), model=model)

    def __str__(self) -> str:
        return str(self.tokens)


def _rows(budget: int | TokenBudget, length: int) -> int:
    return budget.rows(length) if isinstance(budget, TokenBudget) else budget // length


def _tokens(budget: int | TokenBudget) -> int:
    return budget.tokens if isinstance(budget, TokenBudget) else budget


class TooLongForBudget(ValueError):
    """One example alone exceeds the token budget."""


def fewest_groups(lengths: Sequence[int], budget: int | TokenBudget) -> int:
    """The fewest forwards of padded rows under ``budget`` (tokens, or a `TokenBudget`) each."""
    ordered = sorted(lengths, reverse=True)
    _check(ordered, budget)
    groups, i = 0, 0
    while i < len(ordered):
        i += max(1, _rows(budget, ordered[i]))
        groups += 1
    return groups


def step_time_rule(budget: int | TokenBudget) -> str:
    """How `partition_padded` chooses the number of forwards for ``budget``: "fewest" (``padding_target=None``: the
    fewest forwards, whatever they pad), "time" (its ``step_time``: the least modelled step time) or "padding" (no
    step times: more forwards while padded/real exceeds its ``padding_target``)."""
    target = budget.padding_target if isinstance(budget, TokenBudget) else PADDING_TARGET
    if target is None:
        return "fewest"
    return "time" if isinstance(budget, TokenBudget) and budget.step_time is not None else "padding"


def _sorted(lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])  # stable: equal lengths keep their order
    return order, [lengths[i] for i in order]


def _samples_count(sorted_len: list[int], budget: int | TokenBudget, least: int) -> int:
    """Equal micro-batches sized for the window's longest row ("samples" mode's forwards), at least ``least``."""
    n = len(sorted_len)
    return max(least, -(-n // max(1, _rows(budget, sorted_len[-1])))) if n else least


class _LeastPadding:
    """``best[g][i]``: the least cost of the sorted rows ``0..i-1`` in ``g`` groups (inf if none fits), one layer per
    group count, added as asked; `groups(g)` the cut that reaches it. A group's cost is ``group(length, rows)`` of
    its longest row's length (the last, sorted) and its rows: by default its padded tokens, ``rows x length``; under
    a step-time model the modelled seconds of that forward."""

    def __init__(self, sorted_len: list[int], budget: int | TokenBudget, up_to=None):
        self.sorted_len, self.budget = sorted_len, budget
        n = len(sorted_len)
        # each row's capacity and the cost of each group it may close, once: a layer reads them O(n x rows) times,
        # once per window step in training (``up_to(length, most)``: the costs of 0..most rows at ``length``, a
        # step-time model's kept for the run: `step_time.Forwards.up_to`)
        self.fits = [min(_rows(budget, length), i + 1) for i, length in enumerate(sorted_len)]
        up_to = up_to or (lambda length, most: range(0, (most + 1) * length, length))
        self.costs = [up_to(length, fits) for length, fits in zip(sorted_len, self.fits)]
        self.best = [[0.0] + [float("inf")] * n]
        self.cut = [[0] * (n + 1)]

    def padded(self, g: int) -> float:
        while len(self.best) <= g:
            self._layer()
        return self.best[g][-1]

    def _layer(self) -> None:
        n, prev = len(self.sorted_len), self.best[-1]
        layer, where = [float("inf")] * (n + 1), [0] * (n + 1)
        for i in range(1, n + 1):
            fits, costs = self.fits[i - 1], self.costs[i - 1]  # the group's longest row: the last, sorted
            for j in range(i - 1, max(-1, i - 1 - fits), -1):
                c = prev[j] + costs[i - j]
                if c < layer[i]:
                    layer[i], where[i] = c, j
        self.best.append(layer)
        self.cut.append(where)

    def groups(self, g: int) -> list[tuple[int, int]]:
        """The sorted rows' ``[lo, hi)`` bounds of the least-cost cut into ``g`` groups."""
        n = len(self.sorted_len)
        if self.padded(g) == float("inf"):  # cannot happen for g >= the fewest; a guard against a wrong budget
            raise TooLongForBudget(f"no cut of {n} rows into {g} forwards fits {self.budget} tokens")
        bounds, i = [], n
        for layer in range(g, 0, -1):
            bounds.append((self.cut[layer][i], i))
            i = self.cut[layer][i]
        return bounds[::-1]


def _table(sorted_len: list[int], budget: int | TokenBudget) -> _LeastPadding:
    """The cuts by least padding, or under the "time" rule by least modelled seconds of their forwards."""
    if step_time_rule(budget) != "time":
        return _LeastPadding(sorted_len, budget)
    return _LeastPadding(sorted_len, budget, budget.forwards().up_to)


def partition_padded(lengths: Sequence[int], budget: int | TokenBudget, groups: int | None = None) -> list[list[int]]:
    """Row indices grouped into forwards (shortest rows first): each group's rows fit ``budget`` at its longest
    row's length (``rows x longest <= budget`` for a plain token count), at least the fewest groups (and ``groups``
    when given), as many as `step_time_rule` says (the least modelled step time; or more while the padding exceeds
    the target, never past "samples" mode's count), then the least padding."""
    order, sorted_len = _sorted(lengths)
    n = len(order)
    least = fewest_groups(sorted_len, budget)
    k = max(least, min(groups or least, n))
    most = _samples_count(sorted_len, budget, k)
    rule = step_time_rule(budget)
    table = _table(sorted_len, budget)
    if rule == "time":  # each group's cost holds its forward's: the least table entry is the least step
        k = min(range(k, most + 1), key=lambda g: (table.padded(g), g))  # fewer forwards on a tie
    elif rule == "padding":
        target, real = budget.padding_target if isinstance(budget, TokenBudget) else PADDING_TARGET, sum(sorted_len)
        while k < most and table.padded(k) > target * real:
            k += 1
    return [[order[r] for r in range(lo, hi)] for lo, hi in table.groups(k)]


def candidate_cuts(lengths: Sequence[int], budget: int | TokenBudget) -> dict[int, list[list[int]]]:
    """Every cut `partition_padded` may choose for one window, by its number of forwards: from the fewest up to
    "samples" mode's count, each the least padding (under the "time" rule: the least modelled seconds) at that many."""
    order, sorted_len = _sorted(lengths)
    least = fewest_groups(sorted_len, budget)
    table = _table(sorted_len, budget)
    return {g: [[order[r] for r in range(lo, hi)] for lo, hi in table.groups(g)]
            for g in range(least, _samples_count(sorted_len, budget, least) + 1)}


def partition_packed(lengths: Sequence[int], budget: int | TokenBudget,
                     groups: int | None = None) -> list[tuple[int, int]]:
    """Consecutive sequences ``[lo, hi)`` of a padding-free row, each group's total tokens ``<= budget`` (its
    ``tokens``: padding-free rows are not padded rows, the cost model does not describe them); at least
    ``groups`` groups (the largest group is split further until there are that many)."""
    budget = _tokens(budget)
    _check(lengths, budget)
    out, lo, total = [], 0, 0
    for i, n in enumerate(lengths):
        if total + n > budget and i > lo:
            out.append((lo, i))
            lo, total = i, 0
        total += n
    out.append((lo, len(lengths)))
    while groups and len(out) < min(groups, len(lengths)):
        widest = max(range(len(out)), key=lambda g: out[g][1] - out[g][0])
        lo, hi = out[widest]
        mid = (lo + hi) // 2
        out[widest:widest + 1] = [(lo, mid), (mid, hi)]
    return out


def padded_tokens(lengths: Sequence[int], groups: list[list[int]]) -> int:
    return sum(len(g) * max(lengths[i] for i in g) for g in groups)


def _check(lengths: Sequence[int], budget: int | TokenBudget) -> None:
    longest = max(lengths, default=0)
    if longest and _rows(budget, longest) < 1:
        raise TooLongForBudget(f"an example of {longest} tokens exceeds the token budget of {budget} per forward")


def plan_budget(plan) -> TokenBudget | None:
    """The window engine's token budget for ``plan`` (a `probing.plan.Plan`; None, or a plan without a token
    budget: the engine cuts by rows)."""
    if plan is None or plan.token_budget is None:
        return None
    return TokenBudget(plan.token_budget, plan.token_model, step_time=plan.step_time)
