"""One model on paper, many cards: the what-fits-where grid's searches at one sequence length and checkpointing
level share the model's build, its warm-up step and every step already run.

A step's peak does not depend on the card, only the search's verdicts do, so each card's search (the probe's own,
`loop.probe_micro_batches`, from its own budget) is run on one warmed model, and a size an earlier card's search
stepped is read back instead of stepped again (`Remembered`). Every step frees what it allocated and the meter
empties the allocator's cache before each one, so a size measured after other sizes measures what it would first
(`tests/probing/test_fits.py` checks every cell against that card's own `estimate`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from .estimate import (
    checkpoint_lever,
    cuda_assumptions,
    device_session,
    estimate_batch,
    on_paper,
    optimizer_kwargs,
    to_fake,
)
from .loop import ProbeResult, probe_micro_batches
from .meters import Measurement
from .paper_meter import PaperMeter
from .paper_quantized import quantized_model
from .plan import forward_breakpoints
from .probe import seq_len_problem, stepping
from .reserved import expandable_from_env


class Remembered:
    """A meter that steps each micro-batch size once: a size measured before is answered from what it measured."""

    def __init__(self, meter: PaperMeter) -> None:
        self.meter = meter
        self.seen: dict[int, Measurement] = {}

    def measure(self, fn: Callable[[], Any], *, micro_batch_size: int | None = None) -> Measurement:
        if micro_batch_size not in self.seen:
            self.seen[micro_batch_size] = self.meter.measure(fn, micro_batch_size=micro_batch_size)
        return self.seen[micro_batch_size]

    def __getattr__(self, name: str) -> Any:  # the rest of the meter as it is (capacity, catches_oom, time, ...)
        return getattr(self.meter, name)


class PaperSession:
    """``build()`` on fake tensors at ``seq_len``, ``checkpoint_layers`` pinned (None, "all" or k), warmed once;
    `fit` searches one card's budget. A context manager: the fake session lasts as long as the block.

    ``quantization``/``quantization_options`` as `estimate.estimate_model`'s; ``capacity``: the largest card (a
    budget is checked against it)."""

    def __init__(self, build: Callable[[], torch.nn.Module], *, seq_len: int, device: str, bf16: bool,
                 capacity: int, quantization: str | None = None, quantization_options: dict[str, Any] | None = None,
                 checkpoint_layers: str | int | None = None) -> None:
        if checkpoint_layers == "auto":
            raise ValueError("checkpoint_layers='auto' is a search over levels: a session holds one level")
        self.seq_len, self.device, self.bf16, self.capacity = seq_len, device, bf16, capacity
        self._build = build
        self._quantization = (quantization, quantization_options or {})
        self._checkpoint_layers = checkpoint_layers
        self._stack = contextlib.ExitStack()
        self._warm = False
        self.loss = ""
        self.assumptions: tuple[str, ...] = ()

    def __enter__(self) -> PaperSession:
        with torch.device("meta"):
            model = quantized_model(self._build(), self._quantization[0], **self._quantization[1])
        problem = seq_len_problem(model, self.seq_len, "seq_len")
        if problem:
            raise ValueError(problem)
        checkpoint_lever(model, self._checkpoint_layers)  # a pinned level is set on the model, as the estimate
        self.loss = on_paper(model, self.device, self.bf16)
        expandable = expandable_from_env()
        self.assumptions = cuda_assumptions(expandable) if self.device == "cuda" else ()
        with contextlib.ExitStack() as stack:
            counter = stack.enter_context(device_session(self.device, expandable))
            to_fake(model)
            paper = PaperMeter(counter, model, self.capacity, self.device)
            stack.callback(paper.close)
            self._step, _ = stack.enter_context(stepping(
                model, make_batch=estimate_batch(model, self.seq_len), optimizer_kwargs=optimizer_kwargs(self.device),
                autocast_dtype=torch.bfloat16 if self.bf16 else None, meter=paper))
            self.meter = Remembered(paper)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def fit(self, budget: int, cap: int, per_rank: int) -> ProbeResult:
        """The probe's micro-batch search for ``budget`` up to ``cap`` (``per_rank``: the window the plan cuts, as
        `probe.probe_model` passes it); the first search runs the warm-up step."""
        result = probe_micro_batches(self._step, self.meter, budget, cap, must_resolve=forward_breakpoints(per_rank),
                                     warmup=not self._warm)
        self._warm = True
        return result


class OneAtATime:
    """The open session for a key (the grid's: sequence length and lever), opened by ``open_session(*key)`` when first
    asked for; asking for another key closes it first, so one model on paper is alive at a time."""

    def __init__(self, open_session: Callable[..., PaperSession]) -> None:
        self._open = open_session
        self._key: tuple | None = None
        self._session: PaperSession | None = None

    def __call__(self, *key: Any) -> PaperSession:
        if key != self._key:
            self.close()
            self._session = self._open(*key).__enter__()
            self._key = key
        return self._session

    def close(self) -> None:
        if self._session is not None:
            session, self._session, self._key = self._session, None, None
            session.__exit__(None, None, None)

    def __enter__(self) -> OneAtATime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
