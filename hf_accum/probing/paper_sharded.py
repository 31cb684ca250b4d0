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
from collections.abc import Callable
from typing import Any

import torch

from .estimate import CUDA_GRANULE, batch_for, checkpoint_lever, fake_session, on_paper, optimizer_kwargs, to_fake
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
    root = tuple(param(p) for p in model.parameters() if id(p) not in seen)
    return Counts(tuple(units), root)


class Phases:
    """``build()`` on fake tensors at ``seq_len``; `activations(m)`: forward + backward of micro-batch m, the bytes
    above the weights and allocated gradients (each size stepped once); `optimizer`: AdamW's step's temporaries.
    A context manager: the fake session lasts as long as the block."""

    def __init__(self, build: Callable[[], torch.nn.Module], *, seq_len: int, device: str, bf16: bool,
                 checkpoint_layers: str | int | None = None, quantization: str | None = None,
                 quantization_options: dict[str, Any] | None = None, task: str = "causal_lm") -> None:
        self.seq_len, self.device, self.bf16, self.task = seq_len, device, bf16, task
        self._build, self._quantization = build, (quantization, quantization_options or {})
        self._checkpoint_layers = checkpoint_layers
        self._stack = contextlib.ExitStack()
        self.measured: dict[int, int] = {}
        self.optimizer = 0
        self.loss = ""

    def __enter__(self) -> Phases:
        with torch.device("meta"):
            model = quantized_model(self._build(), self._quantization[0], **self._quantization[1])
        problem = seq_len_problem(model, self.seq_len, "seq_len")
        if problem:
            raise ValueError(problem)
        checkpoint_lever(model, self._checkpoint_layers)  # a pinned level, set as the trainer sets it
        self.loss = on_paper(model, self.device, self.bf16)
        self.counts = counts_of(model)
        with contextlib.ExitStack() as stack:
            self.counter = stack.enter_context(fake_session(CUDA_GRANULE if self.device == "cuda" else 1))
            to_fake(model)
            self.model = model
            self.trainable = [p for p in model.parameters() if p.requires_grad]
            for p in self.trainable:
                p.grad = torch.zeros_like(p)
            self.make_batch = batch_for(self.task)(model, self.seq_len)
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

    def activations(self, micro: int) -> int:
        if micro not in self.measured:
            self.measured[micro] = self._measured(lambda: self._forward_backward(micro))
        return self.measured[micro]

    def _forward_backward(self, micro: int) -> None:
        self.model.train()
        batch = self.make_batch(micro)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with ctx:
            loss = self.model(**batch).loss
        loss.backward()
