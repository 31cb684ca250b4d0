"""What a forward costs, by which a token budget's window is cut into the number of forwards whose step is fastest
(``micro_batching="tokens"``): pure functions of the probe's timed steps (`probing.step_timing`).

The model a probe fits now (`fit_step_time`): ``{"optimizer_seconds": O, "forward_seconds_by_rows": {length:
{rows: seconds}}}``. At each length it measured, the probe times one optimizer step of one forward at its largest
fit, half of it, a quarter, ... down to one row, and the optimizer's step alone (``O``, which a window pays once): a
forward of ``rows`` rows padded to ``length`` costs its step less ``O``. No fixed cost per forward plus a cost per
token describes what was measured (benchmarks/bench_token_budget.py part 4, a window of 64 equal rows in k
forwards): cutting one large forward in two costs about nothing on a CPU, where smaller forwards run faster per
token, while each forward more of a few rows costs milliseconds. Timing every size a cut may use reads both.
Between timed sizes and lengths the cost is interpolated (`Forwards`).

The earlier model, ``{"forward_seconds": F, "token_seconds": {length: c}}`` (a forward costs ``F + rows x length x
c``), is still read: a plan file stored with it cuts the same windows as before (`Forwards`)."""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence

SIZED = "forward_seconds_by_rows"


def fit_step_time(timed: dict[int, dict[int, float]], optimizer: Sequence[float] = ()) -> dict | None:
    """The step-time model from the probe's timed steps: ``timed[length][rows]`` the seconds of one optimizer step of
    one forward of ``rows`` rows padded to ``length``; ``optimizer`` the seconds of the optimizer's step alone, one
    per probe that timed it (their median is taken; none: 0, every forward then carries it).

    - A forward of ``rows`` rows at ``length`` costs its step less the optimizer's (an untimed step, 0 seconds, is
      an out-of-memory error: left out).
    - Never less with more rows: a forward holding more of the same rows does more work, so a smaller figure at a
      larger size is noise, raised to the smaller size's (the cut then never takes a larger forward for a cheaper
      one that cannot be). A step measured below the optimizer's alone is noise too: 0.

    None (the padding rule cuts) when no length was timed at two sizes (nothing says how a forward's cost grows with
    its rows), or no forward cost comes out above 0."""
    op = max(0.0, statistics.median(optimizer)) if optimizer else 0.0
    sizes: dict[str, dict[str, float]] = {}
    for length, by_rows in sorted(timed.items()):
        points = sorted((int(rows), sec) for rows, sec in by_rows.items() if sec and sec > 0)
        floor, costs = 0.0, {}
        for rows, sec in points:
            floor = max(floor, sec - op)
            costs[str(rows)] = floor
        if costs:
            sizes[str(length)] = costs
    if not any(len(costs) >= 2 for costs in sizes.values()):
        return None
    if not any(v > 0 for costs in sizes.values() for v in costs.values()):
        return None
    return {"optimizer_seconds": op, SIZED: sizes}


def check(st: dict) -> str | None:
    """What is wrong with a stored model ``st`` (a plan file's ``step_time``), or None."""
    if not isinstance(st, dict):
        return "a step-time model is a mapping"
    if SIZED in st:
        sizes, op = st[SIZED], st.get("optimizer_seconds")
        if not isinstance(op, (int, float)) or op < 0:
            return "optimizer_seconds >= 0"
        if not isinstance(sizes, dict) or not sizes or not all(
                isinstance(by_rows, dict) and by_rows and all(str(rows).isdigit() and int(rows) >= 1 and
                                                              isinstance(s, (int, float)) and s >= 0
                                                              for rows, s in by_rows.items())
                for by_rows in sizes.values()) or not all(str(length).isdigit() for length in sizes):
            return "forward_seconds_by_rows {length: {rows: seconds >= 0}}"
        return None
    per_token = st.get("token_seconds")
    if (not isinstance(st.get("forward_seconds"), (int, float)) or st["forward_seconds"] < 0
            or not isinstance(per_token, dict) or not per_token
            or not all(isinstance(v, (int, float)) and v > 0 for v in per_token.values())):
        return "forward_seconds >= 0 and token_seconds {length: seconds per token > 0}"
    return None


def describe(st: dict) -> str:
    """The plan line's words for ``st``."""
    if SIZED in st:
        lengths = "/".join(sorted(st[SIZED], key=int))
        return f"forwards timed at each size at lengths {lengths}, the optimizer's step {st['optimizer_seconds']:.3g} s"
    return f"a forward's fixed cost {st['forward_seconds']:.3g} s"


class Forwards:
    """``cost(length, rows)``: the modelled seconds of one forward of ``rows`` rows padded to ``length`` by ``st``.

    Sized: at a timed length, linear between its timed sizes (a forward of ``rows`` rows at ``length`` holds
    ``rows x length`` tokens), along the nearest two sizes' line beyond them (at least 0); between two timed lengths,
    linear in the length between the two lengths' costs of a forward of as many tokens (its rows at each length
    being ``tokens / length``: the same tokens, attention's share growing with the length); outside them, the
    nearest timed length's cost of as many tokens."""

    def __init__(self, st: dict):
        self.st = st
        self.sized = SIZED in st
        if self.sized:
            self.lengths = sorted(int(length) for length in st[SIZED])
            self.points = {int(length): sorted((int(r), s) for r, s in by_rows.items())
                           for length, by_rows in st[SIZED].items()}
            self.rows = {length: [r for r, _ in pts] for length, pts in self.points.items()}
        self.optimizer = float(st.get("optimizer_seconds", 0.0))
        self._known: dict[int, list[float]] = {}

    def up_to(self, length: int, most: int) -> list[float]:
        """``[0, cost(length, 1), ..., cost(length, most)]`` (at least): computed once per length and kept, since a
        run cuts every window by the same model and a window's cut reads each row's list (`token_budget`)."""
        known = self._known.setdefault(length, [0.0])
        known.extend(self.cost(length, rows) for rows in range(len(known), most + 1))
        return known

    def cost(self, length: int, rows: int) -> float:
        if not self.sized:
            return self.st["forward_seconds"] + rows * length * token_seconds(self.st, length)
        tokens = rows * length
        ls = self.lengths
        if length <= ls[0]:
            return self._at(ls[0], tokens)
        if length >= ls[-1]:
            return self._at(ls[-1], tokens)
        i = bisect.bisect_left(ls, length)
        lo, hi = ls[i - 1], ls[i]  # lo < length <= hi
        w = (length - lo) / (hi - lo)
        return (1 - w) * self._at(lo, tokens) + w * self._at(hi, tokens)

    def _at(self, length: int, tokens: float) -> float:
        """A forward of ``tokens`` tokens at a timed ``length`` (``tokens / length`` rows, maybe fractional)."""
        points, xs, rows = self.points[length], self.rows[length], tokens / length
        if len(points) == 1:
            (r0, s0), = points
            return s0 * rows / r0
        i = min(max(bisect.bisect_left(xs, rows), 1), len(xs) - 1)
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        return max(0.0, y0 + (y1 - y0) * (rows - x0) / (x1 - x0))


def token_seconds(step_time: dict, length: int) -> float:
    """The earlier model's cost of one padded token of a row padded to ``length``: linear between the timed lengths,
    the nearest one's beyond them."""
    points = sorted((int(k), v) for k, v in step_time["token_seconds"].items())
    if length <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if length <= x1:
            return y0 + (y1 - y0) * (length - x0) / (x1 - x0)
    return points[-1][1]


def modelled_seconds(step_time: dict, lengths: Sequence[int], groups: list[list[int]]) -> float:
    """What one optimizer step of the forwards ``groups`` of rows of ``lengths`` takes by ``step_time``: the
    optimizer's step once, and each forward's cost at its longest row's length."""
    forwards = Forwards(step_time)
    return forwards.optimizer + sum(forwards.cost(max(lengths[i] for i in g), len(g)) for g in groups)


def packed_seconds(step_time: dict, spans: list[list[int]]) -> float:
    """What one optimizer step of padding-free forwards takes by ``step_time``: each forward a row of consecutive
    sequences (``spans``, each a list of their lengths). A packed sequence's attention is its own length's, so its
    tokens cost what a token costs in a padded forward of as many tokens at its length."""
    forwards = Forwards(step_time)
    total = 0.0
    for span in spans:
        tokens = sum(span)
        if forwards.sized:
            total += sum(n / tokens * forwards.cost(n, tokens / n) for n in span if n)
        else:
            total += step_time["forward_seconds"] + sum(n * token_seconds(step_time, n) for n in span)
    return forwards.optimizer + total
