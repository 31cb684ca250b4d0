"""Cutting a window under a token budget (``micro_batching="tokens"``): pure functions of lengths.

A forward of padded rows costs ``rows x longest`` tokens; the budget is the most tokens one forward may hold
(measured by the probe at the worst-case length and checked at a short one). Rows are sorted by length, so each
chunk pads only to its own longest row, and cut into contiguous groups:

1. the fewest forwards: greedily from the longest row, each group as large as the budget allows (optimal: the
   group holding the longest remaining row can hold at most ``budget // longest`` rows, and taking the next
   longest ones leaves the shortest, cheapest rows for later groups);
2. among partitions with that many groups (or with ``groups`` forced higher, so that every rank runs the same
   number of forwards), the one with the least padding: a small dynamic programme over the sorted lengths;
3. where the probe measured what a forward costs beyond its tokens (``TokenBudget.forward_tokens``, from its
   trials' times), one more forward while the padding it saves exceeds that cost.

Padding-free rows cost their total tokens (no padding): consecutive sequences are packed greedily.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace


def cost_model(base: float, per_row: dict[int, float]) -> dict[str, float]:
    """What a step's peak costs, from the probe's measured lines ``peak ≈ base + rows x per_row[length]`` at each
    measured padded length: ``peak ≈ base + rows x (per_token x length + per_token_sq x length²)``. The
    per-token term holds activations; the quadratic one holds eager attention's score matrices (about 0 with
    SDPA / flash attention). A cost that depends only on the row count is folded into them: in a transformer
    every activation has a sequence dimension. It explains the budget; the budget itself is the smaller of the
    measured token capacities, never this model extrapolated."""
    (short, s_short), (long, s_long) = sorted(per_row.items())[0], sorted(per_row.items())[-1]
    quad = (s_long / long - s_short / short) / (long - short) if long != short else 0.0
    return {"base_bytes": float(base), "per_token_bytes": s_short / short - quad * short,
            "per_token_sq_bytes": quad, "lengths": sorted(per_row)}


def predicted_peak(model: dict[str, float], rows: int, length: int) -> float:
    return model["base_bytes"] + rows * (model["per_token_bytes"] * length + model["per_token_sq_bytes"] * length ** 2)


@dataclass(frozen=True)
class TokenBudget:
    """What one forward of padded rows may hold: ``rows(length)`` rows padded to ``length``.

    ``tokens`` holds at every length (the smaller of the token capacities measured at the two probed lengths, or
    a given ``max_tokens_per_forward``): ``rows = tokens // length``. With the probe's ``model`` (`cost_model`
    plus ``usable_bytes``: the budget less the base and less the model's worst under-prediction of a measured
    step, and ``rows_at``: the rows measured to fit at each probed length), a length between the probed ones
    may hold more rows, as many as the model predicts fit. Between the two measured lengths the model never
    under-predicts a cost of the form ``a + b*length + c*length^2`` per row with ``a >= 0`` (the difference is
    ``a (length - short)(length - long) / (short * long) <= 0``); outside them it is not used."""

    tokens: int
    model: dict | None = None
    forward_tokens: float | None = None  # what one more forward costs, in padded tokens (None: fewest forwards)

    def rows(self, length: int) -> int:
        floor = self.tokens // length
        m = self.model
        if not m or not m["lengths"][0] <= length <= m["lengths"][-1]:
            return floor
        measured = {int(k): v for k, v in m["rows_at"].items()}
        if length in measured:
            return max(floor, measured[length])
        per_row = m["per_token_bytes"] * length + m["per_token_sq_bytes"] * length ** 2
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
    ``groups``, at least that many), then the least padding."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    sorted_len = [lengths[i] for i in order]
    n = len(order)
    least = fewest_groups(sorted_len, budget)
    k = max(least, min(groups or least, n))
    per_forward = budget.forward_tokens if isinstance(budget, TokenBudget) else None
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
        # one more forward only while it saves more padded tokens than a forward costs (measured, in tokens)
        if per_forward is None or g == n or best[g][n] - _next_best(best[g], sorted_len, budget) <= per_forward:
            break
    k = g
    if best[k][n] == inf:  # cannot happen for k >= least; kept as a guard against a wrong budget
        raise TooLongForBudget(f"no cut of {n} rows into {k} forwards fits {budget} tokens")
    bounds, i = [], n
    for g in range(k, 0, -1):
        bounds.append((cut[g][i], i))
        i = cut[g][i]
    return [[order[r] for r in range(lo, hi)] for lo, hi in reversed(bounds)]


def _next_best(layer: list[float], sorted_len: list[int], budget) -> float:
    """Least padded tokens of all rows in one group more than ``layer`` has (``layer[i]``: rows 0..i-1)."""
    n = len(sorted_len)
    out = float("inf")
    fits = _rows(budget, sorted_len[-1])
    for j in range(n - 1, max(-1, n - 1 - fits), -1):
        out = min(out, layer[j] + (n - j) * sorted_len[-1])
    return out


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
