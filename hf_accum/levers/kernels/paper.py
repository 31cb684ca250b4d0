"""A kernel on paper: the estimate's stand-in for a kernel whose allocations fake tensors do not see (torch's
`linear_cross_entropy` allocates inside one operator; Liger's and Cut Cross-Entropy's inside Triton launches). It
allocates what the kernel's memory model says (`base.Memory`) when the kernel would -- ``held`` from the forward to
the backward, ``forward`` and ``backward`` inside each pass -- and returns gradients of its inputs' shapes, so the
estimate's storage counter sees the kernel's peak without running it. Its values are meaningless (fake tensors)."""

from __future__ import annotations

import torch


def _bytes(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(max(0, int(n)), dtype=torch.uint8, device=like.device)


class _OnPaper(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, memory):  # memory: base.Memory (base imports this module)
        ctx.memory = memory
        ctx.like = [(t.shape, t.dtype) if t is not None else None for t in (hidden, weight, bias)]
        ctx.grads = None
        held = memory.held
        if memory.grads_in_forward:  # made here, handed on by the backward (torch's kernel scales them in place)
            ctx.grads = [torch.empty(like[0], dtype=like[1], device=hidden.device) if like is not None and needed
                         else None for like, needed in zip(ctx.like, ctx.needs_input_grad[:3])]
            held -= sum(g.numel() * g.element_size() for g in ctx.grads if g is not None)
        ctx.held = _bytes(held, hidden)  # freed when autograd drops ctx
        transient = _bytes(memory.forward, hidden)
        del transient
        return hidden.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        transient = _bytes(ctx.memory.backward, grad)
        del transient
        # The outputs are made while what the forward kept is alive (torch's kernel scales its saved gradients into
        # new tensors); autograd drops ctx, and it, after this returns.
        if ctx.grads is not None:
            grads, ctx.grads = ctx.grads, None
        else:
            grads = [torch.empty(like[0], dtype=like[1], device=grad.device) if like is not None else None
                     for like in ctx.like]
        return (*[g if needed else None for g, needed in zip(grads, ctx.needs_input_grad[:3])], None)


def loss_sum(kernel, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``kernel``'s loss on paper: its memory model realized for these shapes (see the module docstring)."""
    memory = kernel.memory(hidden.shape[0], hidden.shape[1], weight.shape[0], weight.element_size(),
                           hidden.device.type, weight_grad=weight.requires_grad)
    return _OnPaper.apply(hidden, weight, bias, memory)
