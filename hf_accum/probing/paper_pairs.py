"""Preference pairs on paper (placeholder, filled below)."""

from __future__ import annotations

PAIRS = ("dpo", "reward")


def step_for(pairs, model, seq_len):
    if pairs is None:
        return None
    raise ValueError(f"pairs={pairs!r}: give one of None, {', '.join(map(repr, PAIRS))}")
