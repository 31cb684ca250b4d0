"""The arithmetic of a cut: how many forwards a window of ``units`` takes at a size, and how it is cut into
near-equal forwards (padded rows by length, the longest together). Pure functions of counts and lengths; the window
engine (`engine.py`, `units.py`), the plan (`probing/plan.py`) and the planner's policy read them."""

from __future__ import annotations

from collections.abc import Sequence


def forwards_for(units: int, max_units: int) -> int:
    """Forwards needed for ``units`` samples at most ``max_units`` per forward: ``ceil(units / max_units)``."""
    return -(-units // max_units)


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
