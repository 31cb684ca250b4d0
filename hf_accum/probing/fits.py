"""What fits where: one table of the largest micro-batch per card size and sequence length, before anything loads.

`hf-accum probe --estimate --model M --device-memory 24GiB,48GiB,80GiB --seq-len 512,2048,8192`. The peak of a step
does not depend on the card, so per sequence length (and checkpointing lever) the peaks every estimate measured are
pooled: the largest card is estimated first, and a smaller card only where the sizes measured so far do not decide
its edge (`decided_fit`). A card where micro-batch 1 does not fit without checkpointing is estimated with every layer
checkpointed (the only lever tried, and only where needed); one where nothing fits names the smallest card of
`STANDARD_CARDS_GIB` that would (`smallest_card`).

Everything but `measure` and `run` is pure: the grid (`plan_cells`), the reading of peaks, the table and the JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .cards import GIB, card_name
from .paper_session import OneAtATime, PaperSession

#: Card sizes (GiB) "the smallest card that would" is chosen from: the common sizes of NVIDIA's data-centre and
#: consumer cards (8, 16, 24, 40, 48, 80, 96 GB; 141 GB for the H200).
STANDARD_CARDS_GIB = (8, 16, 24, 40, 48, 80, 96, 141)
LEVERS = (None, "all")  # checkpointing: none, else every layer (`checkpoint_layers="all"`)


def parse_list(text: str, parse: Callable[[str], Any], flag: str) -> list:
    """The comma-separated values of ``text`` through ``parse`` (its ValueError names ``flag``), duplicates dropped,
    in the order given."""
    items = [item.strip() for item in str(text).split(",")]
    if any(not item for item in items):
        raise ValueError(f"{flag}={text!r}: an empty value in the list; give e.g. {flag} 512,2048,8192")
    out = []
    for item in items:
        value = parse(item)
        if value not in out:
            out.append(value)
    return out


def largest_fit(peaks: dict[int, int], budget: int, cap: int) -> int:
    """The largest micro-batch up to ``cap`` whose peak fits ``budget``, from the peaks measured at some sizes
    (0: not even 1), reading sizes between measured ones off `peak_at`'s line: a fallback only (`decided_fit`).
    Above the largest size measured nothing is claimed unless that size is ``cap`` itself."""
    sizes = sorted(m for m in peaks if m >= 1)
    if not sizes or sizes[0] > cap or peaks[sizes[0]] > budget:
        return 0
    best = sizes[0]
    for m in range(sizes[0] + 1, min(cap, sizes[-1]) + 1):
        if peak_at(peaks, m) > budget:
            break
        best = m
    return best


def peak_at(peaks: dict[int, int], micro: int) -> int:
    """The peak at ``micro``: measured, else read off a straight line, as `estimate.interpolate` does: a step's
    memory grows linearly with its rows from micro-batch 2 on. Micro-batch 1 is off that line (a single row has no
    padding mask), so where the sizes around ``micro`` are 1 and ``hi``, the line through ``hi`` and the next
    measured size above it is used, never lower than the peak at 1 (a peak set by the optimizer step, not the rows,
    stays flat); with no size above ``hi``, the line from 1 to ``hi``."""
    if micro in peaks:
        return peaks[micro]
    xs = sorted(peaks)
    lo = max(x for x in xs if x < micro)
    hi = min(x for x in xs if x > micro)
    above = [x for x in xs if x > hi]
    if lo == 1 and above:
        lo, hi = hi, above[0]
        return max(peaks[1], round(peaks[lo] + (peaks[hi] - peaks[lo]) * (micro - lo) / (hi - lo)))
    return round(peaks[lo] + (peaks[hi] - peaks[lo]) * (micro - lo) / (hi - lo))


def smallest_card(peak_one: int | None, fraction: float, cards: Sequence[int] = STANDARD_CARDS_GIB) -> int | None:
    """The smallest card (GiB) of ``cards`` whose budget (``fraction`` of it) holds ``peak_one``, the peak at
    micro-batch 1; None when none does or the peak is unknown."""
    if peak_one is None:
        return None
    return next((c for c in sorted(cards) if int(fraction * c * GIB) >= peak_one), None)


@dataclass
class Cell:
    """One card x sequence length: ``micro_batch`` the largest that fits (0: none), at ``checkpointing`` ("none" or
    "all" layers), ``capped`` when it reached the cap (--target-batch / --max-micro-batch: more may fit),
    ``peak_bytes`` its predicted peak; where nothing fits, ``smallest_card_gib`` (None: no standard card, or unknown)
    and ``needs`` (the checkpointing that card needs)."""

    card_bytes: int
    seq_len: int
    micro_batch: int
    checkpointing: str | None
    capped: bool = False
    peak_bytes: int | None = None
    smallest_card_gib: int | None = None
    needs: str | None = None
    more: tuple[int, str, bool] | None = None  # (micro-batch, checkpointing, capped): a lever estimated anyway

    @property
    def fits(self) -> bool:
        return self.micro_batch > 0


def _label(lever: str | int | None) -> str:
    return "none" if lever is None else str(lever)


def decided_fit(peaks: dict[int, int], budget: int, cap: int) -> int | None:
    """The largest micro-batch up to ``cap`` that fits ``budget`` where the sizes measured decide it (the largest
    fitting size is ``cap``, or the size above it was measured not to fit; 0: micro-batch 1 does not fit), else None:
    a card's own estimate must run. Nothing is read off a line: reserved bytes grow in allocator segments, a
    staircase (a line through two sizes of a 2-layer Llama's step put 4 GiB's edge one row too high)."""
    if 1 in peaks and peaks[1] > budget:
        return 0
    fitting = [m for m in peaks if m <= cap and peaks[m] <= budget]
    if not fitting:
        return None
    best = max(fitting)
    if best == cap or peaks.get(best + 1, 0) > budget:
        return best
    return None


def plan_cells(cards: Sequence[int], seq_lens: Sequence[int],
               measure: Callable[[int, str | int | None, int], tuple[dict[int, int], int | None]], *, fraction: float,
               cap: int,
               levers: Sequence[str | int | None] = LEVERS) -> list[Cell]:
    """The grid. Per sequence length and lever the peaks every estimate measured are pooled (a step's peak does not
    depend on the card): the largest card is estimated first (``measure(seq_len, lever, card)``: peaks by
    micro-batch, and that card's largest fit as its estimate concluded it), and a smaller card only where the sizes
    measured so far do not decide its edge (`decided_fit`). The calls come grouped by sequence length, then lever
    (cards largest first), so one model on paper can serve a group (`paper_session.py`).
    The lever (every layer checkpointed) is estimated only for cards where micro-batch 1 does not fit without it.

    A lever whose micro-batch 1 did not fit the largest card at a shorter sequence is not estimated again at a longer
    one (a longer sequence never needs less), unless it is the last lever left: its peak names the smallest card."""
    cells = []
    largest_budget = int(fraction * max(cards))
    too_long: dict[str | int | None, int] = {}  # lever -> the shortest sequence at which micro-batch 1 did not fit
    for seq in sorted(seq_lens):
        known: dict[str | int | None, dict[int, int]] = {lever: {} for lever in levers}
        placed: dict[int, Cell] = {}
        for i, lever in enumerate(levers):
            if lever in too_long and seq > too_long[lever] and i < len(levers) - 1:
                continue
            for card in sorted(cards, reverse=True):
                if card in placed:
                    continue
                budget = int(fraction * card)
                micro = decided_fit(known[lever], budget, cap)
                if micro is None:
                    peaks, own = measure(seq, lever, card)
                    known[lever].update(peaks)
                    if known[lever].get(1, largest_budget + 1) > largest_budget:
                        too_long.setdefault(lever, seq)
                    micro = decided_fit(known[lever], budget, cap)
                    if micro is None:  # the card's own search decided its edge by its line: its answer
                        micro = own if own is not None else largest_fit(known[lever], budget, cap)
                if micro:
                    placed[card] = Cell(card, seq, micro, _label(lever), micro == cap, known[lever].get(micro))
        smallest, needs = _smallest_card_and_lever(known, levers, fraction)
        row = [placed.get(card) or Cell(card, seq, 0, None, smallest_card_gib=smallest, needs=needs)
               for card in cards]
        for cell in row:  # once every card of the row is planned: what a lever estimated for another card shows
            if cell.fits:
                later = levers[[_label(lever) for lever in levers].index(cell.checkpointing) + 1:]
                cell.more = _more(known, later, int(fraction * cell.card_bytes), cap, cell.micro_batch)
        cells += row
    return sorted(cells, key=lambda c: (c.seq_len, c.card_bytes))


def _more(known, later, budget: int, cap: int, micro: int) -> tuple[int, str, bool] | None:
    """A later lever's larger fit on this card, where the sizes that lever's estimates measured (for a smaller card)
    decide it: never an estimate of its own."""
    for lever in later:
        more = decided_fit(known[lever], budget, cap) if known.get(lever) else None
        if more is not None and more > micro:
            return more, _label(lever), more == cap
    return None


def _smallest_card_and_lever(peaks_by_lever, levers, fraction) -> tuple[int | None, str | None]:
    """The smallest standard card any lever fits micro-batch 1 on, and the first lever (fewest) that does."""
    found = [(smallest_card(peaks.get(1), fraction), levers.index(lever), lever)
             for lever, peaks in peaks_by_lever.items() if peaks]
    found = [f for f in found if f[0] is not None]
    if not found:
        return None, None
    card_gib, _, lever = min(found)
    return card_gib, _label(lever)


def cell_text(cell: Cell) -> str:
    if cell.fits:
        checkpointing = "" if cell.checkpointing == "none" else f", checkpointing {cell.checkpointing} layers"
        more = ("" if cell.more is None else
                f" ({cell.more[0]}{'+' if cell.more[2] else ''} checkpointing {cell.more[1]} layers)")
        return f"{cell.micro_batch}{'+' if cell.capped else ''}{checkpointing}{more}"
    if cell.smallest_card_gib is None:
        return f"does not fit (none up to {STANDARD_CARDS_GIB[-1]} GiB)"
    how = "" if cell.needs == "none" else f", checkpointing {cell.needs}"
    return f"does not fit ({cell.smallest_card_gib} GiB would{how})"


def table(cells: Sequence[Cell], cards: Sequence[int], seq_lens: Sequence[int]) -> str:
    """A Markdown table: a row per sequence length, a column per card, each cell the largest micro-batch and the
    levers it needs, or "does not fit" with the smallest card that would."""
    by = {(c.seq_len, c.card_bytes): c for c in cells}
    rows = ["| seq len | " + " | ".join(card_name(c) for c in cards) + " |",
            "|---:|" + "---|" * len(cards)]
    for seq in seq_lens:
        rows.append(f"| {seq} | " + " | ".join(cell_text(by[seq, c]) for c in cards) + " |")
    return "\n".join(rows)


def to_json(cells: Sequence[Cell], settings: dict[str, Any]) -> dict[str, Any]:
    return {"what_fits_where": True, **settings,
            "cells": [{**asdict(c), "card_gib": c.card_bytes / GIB, "fits": c.fits} for c in cells]}


# --- the estimate behind one function ------------------------------------------------------------------------
@dataclass
class Measured:
    peaks: dict[int, int]  # micro-batch -> the predicted bytes the plan fits by (`charged`), at the sizes run
    largest: int  # the largest micro-batch that fits the card, as the estimate's search concluded (0: none)
    loss: str | None  # the loss the estimate assumed (None where micro-batch 1 did not fit: no plan was made)
    assumptions: tuple[str, ...] = ()  # what it assumed of the device (CUDA), likewise


def measure(model, *, seq_len: int, card_bytes: int, cap: int, target_batch_size: int, device: str, bf16: bool,
            fraction: float, lora_r: int | None, lora_target_modules: str | None, fused_loss: bool | None,
            quantization: str | None, checkpoint_layers: str | int | None, quantization_options=None) -> Measured:
    """One card's estimate (``model``: a config folder, a hub id or a callable building the model): the predicted
    peak per micro-batch size its search ran. ``quantization`` ("nf4", "int8") and ``checkpoint_layers`` (None,
    "all", k) as `hf_accum.estimate`'s. Micro-batch 1 not fitting is an answer, not an error: its peak is returned."""
    from .paper import builder

    build = builder(model, lora_r, lora_target_modules, fused_loss)
    with PaperSession(build, seq_len=seq_len, device=device, bf16=bf16, capacity=card_bytes,
                      quantization=quantization, quantization_options=quantization_options,
                      checkpoint_layers=checkpoint_layers) as session:
        return searched(session, int(fraction * card_bytes), cap, target_batch_size)


def searched(session: PaperSession, budget: int, cap: int, per_rank: int) -> Measured:
    """One card's search on ``session`` (its model warmed, the sizes it stepped remembered)."""
    result = session.fit(budget, cap, per_rank)
    if result.max_micro_batch_size < 1:
        return Measured(charged(result.trials), 0, None)
    return Measured(charged(result.trials), result.max_micro_batch_size, session.loss, session.assumptions)


def charged(trials) -> dict[int, int]:
    """Per micro-batch size, the bytes the search compared with the budget: the reserved bytes where the estimate
    predicts them (CUDA: what a GPU probe fits by), else the peak allocated."""
    return {t.micro_batch_size: t.reserved_bytes if t.reserved_bytes is not None else t.peak_bytes
            for t in trials if t.peak_bytes is not None}


def run(args: Any, say=print) -> int:
    """`hf-accum probe --estimate` with a comma list in --device-memory or --seq-len: the table."""
    import json
    import time

    from . import paper

    cards, device, fraction = _cards(args)
    seq_lens = args.seq_len if isinstance(args.seq_len, list) else [args.seq_len]
    per_rank = args.target_batch // args.world_size
    cap = min(args.max_micro_batch or per_rank, per_rank)
    quantization = "nf4" if args.load_in_4bit else "int8" if args.load_in_8bit else None
    lora_r = args.lora_r if args.lora or quantization else None
    levers = _levers(args)
    config = paper.load_config(args.model)
    _check_lengths(config, seq_lens)
    build = paper.builder(paper.config_builder(config), lora_r, args.lora_target_modules, args.fused_loss)
    what = ("QLoRA (" + quantization + f" base, LoRA r={lora_r})" if quantization else
            f"LoRA r={lora_r}" if lora_r else "full fine-tuning")
    say(f"what fits where: {args.model}, {what}, {'bf16 autocast' if args.bf16 else 'no autocast'}, weights "
        f"{paper.weights_dtype(config)}, for {device} (fake tensors: nothing loaded); budget {fraction:g} of each "
        f"card; micro-batch up to {cap}")
    began, cpu = time.perf_counter(), time.process_time()
    losses: list[str] = []
    assumed: list[tuple[str, ...]] = []
    measured: dict[str, dict[str, int]] = {}  # "seq/checkpointing" -> the peaks estimated (for the JSON)

    def one(seq: int, lever, card: int):
        t0 = time.perf_counter()
        out = searched(sessions(seq, lever), int(fraction * card), cap, args.target_batch)
        losses.extend([out.loss] if out.loss else [])
        assumed.extend([out.assumptions] if out.loss else [])
        pooled = measured.setdefault(f"{seq}/{_label(lever)}", {})
        pooled.update({str(m): v for m, v in sorted(out.peaks.items())})
        say(f"  seq {seq}, checkpointing {_label(lever)}: {len(out.peaks)} sizes searched for the {card_name(card)}"
            f" card ({time.perf_counter() - t0:.0f} s)")
        return out.peaks, out.largest

    with OneAtATime(_opener(build, device, args.bf16, max(cards), quantization)) as sessions:
        cells = plan_cells(cards, seq_lens, one, fraction=fraction, cap=cap, levers=levers)
    seconds, cpu_seconds = time.perf_counter() - began, time.process_time() - cpu
    loss, assumptions = _say_table(say, cells, cards, seq_lens, args.target_batch, losses, assumed, device)
    say(f"estimated in {seconds:.0f} s ({cpu_seconds:.0f} s of CPU time)")
    if args.json:
        settings = {"model": args.model, "training": what, "device": device, "bf16": args.bf16,
                    "budget_fraction": fraction, "max_micro_batch": cap, "card_bytes": cards, "seq_lens": seq_lens,
                    "loss": loss, "assumptions": list(assumptions), "seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1),
                    "peaks": measured}
        with open(args.json, "w") as f:
            json.dump(to_json(cells, settings), f, indent=2)
        say(f"wrote {args.json}")
    return 0


def _opener(build, device: str, bf16: bool, capacity: int, quantization: str | None):
    """``open(seq_len, lever)``: the grid's model on paper at that sequence length and checkpointing."""
    import torch

    # the probe's --load-in-4bit, as the single estimate: no double quantization, computing in the autocast dtype
    options = None if quantization is None else {"compute_dtype": torch.bfloat16 if bf16 else torch.float32,
                                                 "double_quant": False}
    return lambda seq, lever: PaperSession(build, seq_len=seq, device=device, bf16=bf16, capacity=capacity,
                                           quantization=quantization, quantization_options=options,
                                           checkpoint_layers=lever)


def _check_lengths(config, seq_lens: Sequence[int]) -> None:
    """Every --seq-len within the model's positions, before any estimate runs."""
    limit = getattr(config, "max_position_embeddings", None)
    too_long = [seq for seq in seq_lens if limit is not None and seq > limit]
    if too_long:
        raise ValueError(f"--seq-len {too_long[0]} exceeds the model's max_position_embeddings={limit}; give lengths "
                         f"<= {limit}")


def _cards(args: Any) -> tuple[list[int], str, float]:
    """The cards (bytes, smallest first), the device and the budget as a fraction of each card."""
    from . import paper

    cards = sorted(parse_list(args.device_memory, paper.parse_size, "--device-memory")) if args.device_memory else []
    device = args.device or ("cuda" if len(cards) > 1 else paper.machine_device())
    if not cards:
        cards = [paper.machine_memory(device, "--device-memory")]
    if args.budget_bytes is not None and len(cards) > 1:
        raise ValueError("--budget-bytes is one budget for one card; with a list of --device-memory give --budget "
                         "(the fraction of each card, default 0.9)")
    fraction = args.budget if args.budget is not None else 0.9
    if args.budget_bytes is not None:
        fraction = args.budget_bytes / cards[0]
    return cards, device, fraction


def _say_table(say, cells, cards: list[int], seq_lens: list[int], target: int, losses: list[str],
               assumed: list[tuple[str, ...]], device: str) -> tuple[str, tuple[str, ...]]:
    """The table and what it assumed; returns the loss line and the assumptions (for the JSON)."""
    from . import paper

    say("")
    say(table(cells, cards, seq_lens))
    say("")
    say(f"N+: micro-batch N, the cap (--target-batch {target} / --max-micro-batch), fits: more may. "
        "A card is estimated where the sizes measured for a larger one do not decide its edge.")
    loss = losses[0] if losses else "loss: not estimated (micro-batch 1 fit on no card)"
    say(f"assumed: {loss}")
    assumptions = assumed[0] if assumed else paper.CUDA_ASSUMPTIONS if device == "cuda" else ()
    for line in assumptions:
        say(f"assumed: {line}")
    return loss, assumptions


def _levers(args: Any) -> tuple[str | int | None, ...]:
    """The checkpointing tried, in order: none, then every layer; a lever the user set is obeyed alone."""
    if args.gradient_checkpointing:
        return ("all",)
    if args.checkpoint_layers not in (None, "auto"):
        return ("all",) if args.checkpoint_layers == "all" else (int(args.checkpoint_layers),)
    return LEVERS
