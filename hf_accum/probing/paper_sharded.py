"""The sharded estimate's measurements: the one-process step on fake tensors, split in its two phases (forward +
backward per micro-batch, then AdamW's step), and the model's weights by FSDP2 unit. `sharding.py` adds each rank's
shards, gathered weights and buffers on top (pure arithmetic).

The activations of a micro-batch do not depend on how the weights are sharded: every rank runs the whole model on
its own rows. So forward + backward is measured once, in one process, with the gradients allocated before it (as
the probe's step keeps them, zeroed): what it adds above the weights and gradients is the micro-batch's activations
and backward's temporaries. AdamW's step is measured after a warm-up step (its state created), as the probe's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..compat.gradient_checkpointing import checkpoint_levels, checkpointed_layers
from .estimate import (
    CHECKPOINT_KWARGS,
    CUDA_GRANULE,
    batch_for,
    fake_session,
    on_paper,
    optimizer_kwargs,
    pinned_level,
    to_fake,
)
from .paper_quantized import quantized_model
from .probe import seq_len_problem
from .sharding import Counts, Param


def counts_of(model: torch.nn.Module) -> Counts:
    """The weights of ``model`` (meta or fake) by FSDP2 unit: each decoder layer, then the rest (the root)."""
    from ..compat.gradient_checkpointing import checkpointable_layers

    def param(p: torch.Tensor) -> Param:
        return Param(tuple(p.shape), p.element_size(), p.requires_grad)

    try:
        layers = list(checkpointable_layers(model))
    except Exception:  # a model with no decoder layers to shard: one unit, the root
        layers = []
    seen: set[int] = set()
    units = []
    for layer in layers:
        units.append(tuple(param(p) for p in layer.parameters() if id(p) not in seen))
        seen |= {id(p) for p in layer.parameters()}
    order = list(model.parameters())
    first_layer = next((i for i, p in enumerate(order) if id(p) in seen), len(order))
    root = tuple(param(p) for p in order if id(p) not in seen)
    leading = sum(1 for p in order[:first_layer] if id(p) not in seen)  # the embeddings, before the layers
    return Counts(tuple(units), root, leading)


class FakeSteps:
    """One model built on fake tensors for every sequence length and checkpointing level a grid asks for: AdamW's
    step measured once (its temporaries depend on the weights alone), each (length, level, micro-batch) stepped once
    (`activations`). A level ("all", k; None: none) is set for its steps and undone after, as a probe trial does,
    so the model is the same whatever order the steps come in. A context manager: the fake session lasts as long as
    the block."""

    def __init__(self, build: Callable[[], torch.nn.Module], *, seq_lens: list[int], device: str, bf16: bool,
                 quantization: str | None = None, quantization_options: dict[str, Any] | None = None,
                 task: str = "causal_lm") -> None:
        self.seq_lens, self.device, self.bf16, self.task = list(seq_lens), device, bf16, task
        self._build, self._quantization = build, (quantization, quantization_options or {})
        self._stack = contextlib.ExitStack()
        self._batches: dict[int, Callable[[int], Any]] = {}
        self.measured: dict[tuple[int, str | int | None], dict[int, int]] = {}
        #: per (length, level): micro-batch -> the bytes above the weights and gradients when the first gradient is
        #: accumulated (where ZeRO-2 allocates its gradient partition and reduce bucket)
        self.at_first_gradient: dict[tuple[int, str | int | None], dict[int, int]] = {}
        self.optimizer = 0
        self.loss = ""

    def __enter__(self) -> FakeSteps:
        with torch.device("meta"):
            model = quantized_model(self._build(), self._quantization[0], **self._quantization[1])
        for seq_len in self.seq_lens:  # every length checked before any step
            problem = seq_len_problem(model, seq_len, "seq_len")
            if problem:
                raise ValueError(problem)
        self.loss = on_paper(model, self.device, self.bf16)
        self.counts = counts_of(model)
        self.levels = checkpoint_levels(model)
        with contextlib.ExitStack() as stack:
            self.counter = stack.enter_context(fake_session(CUDA_GRANULE if self.device == "cuda" else 1))
            to_fake(model)
            self.model = model
            self.trainable = [p for p in model.parameters() if p.requires_grad]
            for p in self.trainable:
                p.grad = torch.zeros_like(p)
            self.optimizer = self._optimizer_step()
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _measured(self, fn: Callable[[], Any]) -> int:
        start = self.counter.current
        self.counter.peak = start
        fn()
        return self.counter.peak - start

    def _optimizer_step(self) -> int:
        opt = torch.optim.AdamW(self.trainable, **optimizer_kwargs(self.device))
        opt.step()  # the warm-up creates the state; the next step's temporaries are the step's
        temporaries = self._measured(opt.step)
        opt.state.clear()
        return temporaries

    def activations(self, seq_len: int, level: str | int | None, micro: int) -> int:
        """Forward + backward of ``micro`` rows of ``seq_len`` with ``level`` checkpointed: the bytes above the
        weights and allocated gradients."""
        measured = self.measured.setdefault((seq_len, level), {})
        if micro not in measured:
            k = 0 if level is None else pinned_level(level, self.levels, self.model)
            first: list[int] = []

            def hook(_p: torch.Tensor) -> None:
                if not first:
                    first.append(self.counter.current)

            hooks = [p.register_post_accumulate_grad_hook(hook) for p in self.trainable]
            start = self.counter.current
            try:
                with checkpointed_layers(self.model, k, CHECKPOINT_KWARGS) if k else contextlib.nullcontext():
                    measured[micro] = self._measured(lambda: self._forward_backward(seq_len, micro))
            finally:
                for h in hooks:
                    h.remove()
            at_first = self.at_first_gradient.setdefault((seq_len, level), {})
            at_first[micro] = first[0] - start if first else measured[micro]
        return measured[micro]

    def first_gradient(self, seq_len: int, level: str | int | None, micro: int) -> int:
        """The bytes above the weights and allocated gradients when the first gradient of ``micro`` rows of
        ``seq_len`` is accumulated (`activations` steps it)."""
        self.activations(seq_len, level, micro)
        return self.at_first_gradient[seq_len, level][micro]

    def _forward_backward(self, seq_len: int, micro: int) -> None:
        if seq_len not in self._batches:
            self._batches[seq_len] = batch_for(self.task)(self.model, seq_len)
        self.model.train()
        batch = self._batches[seq_len](micro)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with ctx:
            loss = self.model(**batch).loss
        loss.backward()


class Phases:
    """`FakeSteps` at one length and one checkpointing level (``checkpoint_layers``): `activations(m)`, `optimizer`,
    `counts`, `measured` (micro-batch -> bytes)."""

    def __init__(self, build: Callable[[], torch.nn.Module], *, seq_len: int, device: str, bf16: bool,
                 checkpoint_layers: str | int | None = None, quantization: str | None = None,
                 quantization_options: dict[str, Any] | None = None, task: str = "causal_lm") -> None:
        self.seq_len, self.level = seq_len, checkpoint_layers
        self.steps = FakeSteps(build, seq_lens=[seq_len], device=device, bf16=bf16, quantization=quantization,
                               quantization_options=quantization_options, task=task)

    def __enter__(self) -> Phases:
        self.steps.__enter__()
        if self.level is not None:  # a level the model cannot take is refused before any step
            pinned_level(self.level, self.steps.levels, self.steps.model)
        self.counts, self.optimizer, self.loss = self.steps.counts, self.steps.optimizer, self.steps.loss
        return self

    def __exit__(self, *exc: Any) -> None:
        self.steps.__exit__(*exc)

    def activations(self, micro: int) -> int:
        return self.steps.activations(self.seq_len, self.level, micro)

    def first_gradient(self, micro: int) -> int:
        return self.steps.first_gradient(self.seq_len, self.level, micro)

    @property
    def measured(self) -> dict[int, int]:
        return self.steps.measured.get((self.seq_len, self.level), {})


# --- the grid: GPU counts x cards x sequence lengths -----------------------------------------------------------
@dataclasses.dataclass
class ShardedEstimate:
    """The sharded estimate: the cells (`fits_sharded.ShardedCell`), the tables, the sharding, what was assumed, and
    per sequence length and lever the activations measured (micro-batch -> bytes) and AdamW's temporaries."""

    cells: list
    sharding: Any
    counts: Counts
    gpus: tuple[int, ...]
    cards: tuple[int, ...]
    seq_lens: tuple[int, ...]
    target_batch_size: int
    activations: dict
    optimizer: dict
    loss: str
    assumptions: tuple[str, ...]

    def table(self) -> str:
        from .fits_sharded import tables

        return tables(self.cells, self.cards, self.seq_lens, self.gpus)

    def cell(self, card: int, seq_len: int, gpus: int):
        return next(c for c in self.cells if (c.card_bytes, c.seq_len, c.gpus) == (card, seq_len, gpus))

    def to_json(self) -> dict[str, Any]:
        from .fits_sharded import to_json

        return to_json(self.cells, self.sharding, self.counts, self.gpus, {
            "target_batch_size": self.target_batch_size, "seq_lens": list(self.seq_lens),
            "cards_gib": [c / 2**30 for c in self.cards], "gpus": list(self.gpus), "loss": self.loss,
            "assumptions": list(self.assumptions),
            "activations": {f"{seq}/{lever or 'none'}": {str(m): v for m, v in sorted(acts.items())}
                            for (seq, lever), acts in self.activations.items()},
            "optimizer_temporaries": {f"{seq}/{lever or 'none'}": v for (seq, lever), v in self.optimizer.items()}})


def sharded_grid(build: Callable[[], torch.nn.Module], *, seq_lens: list[int], cards: list[int], gpus: list[int],
                 sharding, target_batch_size: int, device: str = "cuda", bf16: bool = False, fraction: float = 0.9,
                 max_micro_batch: int | None = None, quantization: str | None = None,
                 quantization_options: dict[str, Any] | None = None, log=None) -> ShardedEstimate:
    """The cells of every card x GPU count x sequence length under ``sharding`` (`sharding.parse_sharding`)."""
    from .fits_sharded import cells_for
    from .plan import indivisible_target
    from .sharding import parse_sharding

    sharding = parse_sharding(sharding)
    for world in gpus:
        problem = indivisible_target(target_batch_size, world)
        if problem:
            raise ValueError(f"gpus={world}: {problem}")
    cells, acts, opts = [], {}, {}
    with FakeSteps(build, seq_lens=sorted(seq_lens), device=device, bf16=bf16, quantization=quantization,
                   quantization_options=quantization_options) as steps:
        optimizer = {None: steps.optimizer, "all": steps.optimizer}  # AdamW's step: the weights' alone
        for seq in sorted(seq_lens):
            activations = {lever: (lambda m, seq=seq, lever=lever: steps.activations(seq, lever, m))
                           for lever in (None, "all")}
            first = {lever: (lambda m, seq=seq, lever=lever: steps.first_gradient(seq, lever, m))
                     for lever in (None, "all")}
            cells += cells_for(steps.counts, sharding, activations, optimizer, seq_len=seq, cards=cards, gpus=gpus,
                               fraction=fraction, target=target_batch_size, max_micro=max_micro_batch,
                               first_gradient=first)
            stepped = {lever: steps.measured[seq, lever] for lever in (None, "all") if (seq, lever) in steps.measured}
            for lever, sizes in stepped.items():
                acts[seq, lever], opts[seq, lever] = dict(sizes), steps.optimizer
            if log:
                log(f"seq {seq}: stepped micro-batches " + "; ".join(
                    f"{'checkpointing all' if lv else 'no checkpointing'} {sorted(sizes)}" for lv, sizes in stepped.items()))
    counts, loss = steps.counts, steps.loss
    assumptions = (sharding.modelled,
                   "per rank: AdamW on the rank's shard; peak allocated bytes (the allocator's reserved bytes are "
                   "left to the budget's margin)")
    return ShardedEstimate(sorted(cells, key=lambda c: (c.card_bytes, c.seq_len, c.gpus)), sharding, counts,
                           tuple(gpus), tuple(cards), tuple(sorted(seq_lens)), target_batch_size, acts, opts, loss,
                           assumptions)

