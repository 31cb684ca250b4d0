"""What fits where across GPU counts: one table per card size, a row per sequence length, a column per GPU count;
each cell the largest micro-batch per rank, the levers and the plan for the target (micro × accumulation × world).

`hf-accum probe --estimate --model M --gpus 1,2,4,8 --sharding fsdp2 --device-memory 24GiB,80GiB --seq-len 512,2048`.
Per sequence length the one-process step is measured once on fake tensors (`paper_sharded.Phases`: the micro-batch's
activations, AdamW's temporaries) and each rank's shards, gathered weights and buffers are added by arithmetic
(`sharding.py`); so a cell costs no step of its own but the sizes around its edge, each stepped once. A size is
guessed off the line through micro-batches 2 and 3, then every size the answer rests on is stepped: the largest
that fits and the one above it. Where micro-batch 1 does not fit without checkpointing, every decoder layer
checkpointed is tried (measured only then). A cell that does not fit names the fewest GPUs of that card (a power of
two up to `MOST_GPUS`) that would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .cards import GIB, card_name
from .plan import plan_batch
from .sharding import Counts, Sharding, rank_bytes, rank_peak

MOST_GPUS = 1024
LEVERS = (None, "all")


@dataclass
class ShardedCell:
    card_bytes: int
    seq_len: int
    gpus: int
    micro_batch: int  # per rank, 0: none fits
    checkpointing: str | None = None  # "none" or "all" layers
    capped: bool = False
    peak_bytes: int | None = None
    plan: str | None = None  # "micro × accumulation × world = target"
    fewest_gpus: int | None = None  # where nothing fits: the fewest GPUs of this card that would (None: none)
    needs: str | None = None

    @property
    def fits(self) -> bool:
        return self.micro_batch > 0


def largest(peak: Callable[[int], int], budget: int, cap: int, guess: int) -> int:
    """The largest micro-batch up to ``cap`` whose ``peak`` fits ``budget`` (0: not even 1), from ``guess``: the
    answer is always stepped, and so is the size above it (below ``cap``); ``peak`` is taken to grow with rows."""
    if peak(1) > budget:
        return 0
    m = max(1, min(cap, guess))
    while m > 1 and peak(m) > budget:
        m -= 1
    while m < cap and peak(m + 1) <= budget:
        m += 1
    return m


def line_guess(act: Callable[[int], int], room: int) -> int:
    """The micro-batch whose activations fill ``room`` bytes on the line through sizes 2 and 3 (a step's memory grows
    linearly with its rows from micro-batch 2 on)."""
    slope = max(1, act(3) - act(2))
    return max(1, int(2 + (room - act(2)) // slope))


def fewest_gpus(fits_at: Callable[[int], bool], most: int = MOST_GPUS) -> int | None:
    """The fewest GPUs (a power of two up to ``most``) at which ``fits_at(world)``; None where none does (ZeRO-1/2
    keep every weight on every rank: more GPUs cannot shrink them)."""
    world = 1
    while world <= most:
        if fits_at(world):
            return world
        world *= 2
    return None


def plan_text(target: int, world: int, micro: int) -> str:
    plan = plan_batch(target, world, micro)
    return f"{plan.micro_batch_size} × {plan.gradient_accumulation_steps} × {world} = {target}"


def fit_on_rank(counts: Counts, sharding: Sharding, world: int, act: Callable[[int], int], optimizer: int,
                budget: int, cap: int, first: Callable[[int], int] | None = None) -> tuple[int, Callable[[int], int]]:
    """The largest micro-batch up to ``cap`` whose rank peak fits ``budget`` (0: not even 1), and the rank peak by
    micro-batch (``act(m)``: the one-process activations; ``optimizer``: AdamW's one-process temporaries;
    ``first(m)``: the one-process bytes at the first gradient, None: unknown)."""

    def peak(m: int) -> int:
        return rank_peak(counts, sharding, world, act(m), optimizer, None if first is None else first(m))

    resident = rank_peak(counts, sharding, world, 0, optimizer)
    if resident > budget or peak(1) > budget:
        return 0, peak
    return largest(peak, budget, cap, line_guess(act, budget - resident)), peak


def cells_for(counts: Counts, sharding: Sharding, activations: dict[str | None, Callable[[int], int]],
              optimizer: dict[str | None, int], *, seq_len: int, cards: Sequence[int], gpus: Sequence[int],
              fraction: float, target: int, max_micro: int | None,
              first_gradient: dict[str | None, Callable[[int], int]] | None = None) -> list[ShardedCell]:
    """The cells of one sequence length. ``activations[lever](m)``: the micro-batch's activations with that
    checkpointing (None, "all"; a lever's callable is only called where the one before it fits nothing);
    ``optimizer[lever]``: AdamW's one-process temporaries; ``first_gradient[lever](m)``: the bytes when the first
    gradient is accumulated (None: unknown, counted as at the activations' peak)."""
    first = first_gradient or {}
    cells = []
    for card in cards:
        budget = int(fraction * card)
        for world in gpus:
            per_rank = target // world
            cap = min(per_rank, max_micro or per_rank)
            cell = None
            for lever in LEVERS:
                m, peak = fit_on_rank(counts, sharding, world, activations[lever], optimizer[lever], budget, cap,
                                      first.get(lever))
                if not m:
                    continue
                cell = ShardedCell(card, seq_len, world, m, "none" if lever is None else "all", m == cap, peak(m),
                                   plan_text(target, world, m))
                break
            if cell is None:
                cell = ShardedCell(card, seq_len, world, 0)
                found = []  # (fewest GPUs, lever position): the fewest GPUs, then the fewest levers
                for i, lever in enumerate(LEVERS):
                    act1 = activations[lever](1)
                    first1 = first[lever](1) if lever in first else None
                    fewest = fewest_gpus(lambda w, a=act1, f=first1, lv=lever, b=budget: rank_peak(
                        counts, sharding, w, a, optimizer[lv], f) <= b)
                    if fewest is not None:
                        found.append((fewest, i))
                if found:
                    fewest, i = min(found)
                    cell.fewest_gpus, cell.needs = fewest, "none" if LEVERS[i] is None else "all"
            cells.append(cell)
    return cells


def cell_text(cell: ShardedCell) -> str:
    if cell.fits:
        levers = "" if cell.checkpointing == "none" else ", checkpointing all layers"
        return f"{cell.micro_batch}{'+' if cell.capped else ''}{levers}: {cell.plan}"
    if cell.fewest_gpus is None:
        return f"does not fit (not on up to {MOST_GPUS} GPUs)"
    how = "" if cell.needs == "none" else ", checkpointing all"
    return f"does not fit ({cell.fewest_gpus} GPUs would{how})"


def tables(cells: Sequence[ShardedCell], cards: Sequence[int], seq_lens: Sequence[int], gpus: Sequence[int]) -> str:
    """One Markdown table per card: a row per sequence length, a column per GPU count."""
    by = {(c.card_bytes, c.seq_len, c.gpus): c for c in cells}
    out = []
    for card in cards:
        out += [f"**{card_name(card)} per GPU**", "",
                "| seq len | " + " | ".join(f"{g} GPU{'s' if g > 1 else ''}" for g in gpus) + " |",
                "|---:|" + "---|" * len(gpus)]
        out += [f"| {seq} | " + " | ".join(cell_text(by[card, seq, g]) for g in gpus) + " |" for seq in seq_lens]
        out.append("")
    return "\n".join(out).rstrip()


def to_json(cells: Sequence[ShardedCell], sharding: Sharding, counts: Counts, gpus: Sequence[int],
            settings: dict[str, Any]) -> dict[str, Any]:
    return {"what_fits_where": True, "sharded": True, "sharding": sharding.label, "modelled": sharding.modelled,
            **settings,
            "rank_bytes": {str(w): rank_bytes(counts, sharding, w).to_json() for w in gpus},
            "cells": [{**asdict(c), "card_gib": c.card_bytes / GIB, "fits": c.fits} for c in cells]}
