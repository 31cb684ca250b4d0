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
3. one more forward while the window's padded tokens exceed ``PADDING_TARGET`` (1.10) times its real tokens, up to
   as many forwards as equal micro-batches sized for the window's longest row would take ("samples" mode's count).
   At the fewest forwards a long-tailed window pads ~1.29 tokens per real token (benchmarks/bench_token_budget.py,
   part 1): the few longest rows fill a forward with rows much shorter than they are, and no cut into that many
   forwards does better (step 2 is optimal). The rule reads only the lengths and the budget -- not the probe's
   step times, which differ between two runs of the same command -- so the same window is always cut the same way.

Padding-free rows cost their total tokens (no padding): consecutive sequences are packed greedily.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

PADDING_TARGET = 1.10  # padded / real tokens of a window above which one more forward is taken (see step 3)


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
    padding_target: float | None = PADDING_TARGET  # None: the fewest forwards, whatever they pad

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


def partition_padded(lengths: Sequence[int], budget: int | TokenBudget, groups: int | None = None) -> list[list[int]]:
    """Row indices grouped into forwards (shortest rows first): each group's rows fit ``budget`` at its longest
    row's length (``rows x longest <= budget`` for a plain token count), the fewest groups (or exactly
    ``groups``, at least that many), more while the padding exceeds the budget's ``padding_target`` (a plain
    token count: `PADDING_TARGET`) and "samples" mode would take more, then the least padding."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])  # stable: equal lengths keep their order
    sorted_len = [lengths[i] for i in order]
    n = len(order)
    least = fewest_groups(sorted_len, budget)
    k = max(least, min(groups or least, n))
    target = budget.padding_target if isinstance(budget, TokenBudget) else PADDING_TARGET
    # never more forwards than equal micro-batches sized for the window's longest row ("samples" mode's plan)
    most = max(k, -(-n // max(1, _rows(budget, sorted_len[-1])))) if n else k
    real = sum(sorted_len)  # the tokens the rows hold: a cut stops adding forwards once its padding is within target
    inf = float("inf")
    # best[g][i]: least padded tokens of rows 0..i-1 in g groups (inf if none fits); one layer per group count
    best = [[0.0] + [inf] * n]
    cut = [[0] * (n + 1)]
    g = 0
    while True:
        g += 1
        layer, where = [inf] * (n + 1), [0] * (n + 1)
        for i in range(1, n + 1):
            longest = sorted_len[i - 1]
            fits = _rows(budget, longest)
            for j in range(i - 1, -1, -1):
                if i - j > fits:
                    break
                c = best[g - 1][j] + (i - j) * longest
                if c < layer[i]:
                    layer[i], where[i] = c, j
        best.append(layer)
        cut.append(where)
        if g < k:
            continue
        if target is None or g >= most or best[g][n] <= target * real:
            break
    k = g
    if best[k][n] == inf:  # cannot happen for k >= least; kept as a guard against a wrong budget
        raise TooLongForBudget(f"no cut of {n} rows into {k} forwards fits {budget} tokens")
    bounds, i = [], n
    for g in range(k, 0, -1):
        bounds.append((cut[g][i], i))
        i = cut[g][i]
    return [[order[r] for r in range(lo, hi)] for lo, hi in reversed(bounds)]


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
    return TokenBudget(plan.token_budget, plan.token_model)
