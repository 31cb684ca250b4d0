"""The loss kernels (hf_accum/kernels/): every registered kernel that runs here, through the fused loss's seam, against
the independent float64 reference -- each sequence forwarded alone, cross-entropy by hand (log-sum-exp written out),
summed over the counted targets -- on padded rows, padding-free batches and DPO-style pairs, with prompts ignored
(-100) and label smoothing where the kernel computes it. A kernel that does not compute a setting is refused, naming
itself and the setting."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DataCollatorWithFlattening

import hf_accum.fused_loss as fl
from hf_accum import kernels
from tests.exactness import lm_examples, pad_collate, tiny_llama

TOL = 1e-10
HERE = kernels.runnable("cpu", torch.float64)


def by_hand(model, examples, label_smoothing=0.0, packed=None):
    """Sum of the token losses of ``examples``, each forwarded alone, and their count (float64, no library code).
    ``packed``: a padding-free row forwarded once instead (SDPA/eager on CPU attend across its sequences, so "alone"
    would be a different model output), cut into its sequences by hand."""
    head = model.get_output_embeddings().weight
    total, count = torch.zeros((), dtype=torch.float64), 0
    states = None if packed is None else model.model(**packed).last_hidden_state[0]
    start = 0
    for ex in examples:
        ids = torch.tensor([ex["input_ids"]])
        if states is None:
            hidden = model.model(input_ids=ids).last_hidden_state[0, :-1]
        else:
            hidden = states[start:start + ids.shape[1] - 1]
            start += ids.shape[1]
        targets = torch.tensor(ex["labels"][1:])
        keep = targets != -100
        logits = hidden[keep] @ head.T
        logp = logits - (logits - logits.max(-1, keepdim=True).values).exp().sum(-1, keepdim=True).log() \
            - logits.max(-1, keepdim=True).values
        nll = -logp.gather(1, targets[keep].unsqueeze(1)).squeeze(1)
        smooth = -logp.mean(-1)
        total = total + ((1 - label_smoothing) * nll + label_smoothing * smooth).sum()
        count += int(keep.sum())
    return total, count


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(got, want):
    return max(float((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-300)) for n in want)


def padded(examples):
    return pad_collate(examples)


def padding_free(examples):
    return dict(DataCollatorWithFlattening(return_position_ids=True)(examples))


def pairs(examples):
    """DPO-style: each prompt with two answers (chosen, rejected), the prompt ignored in both."""
    out = []
    for a, b in zip(examples[::2], examples[1::2]):
        prompt = [t for t, lab in zip(a["input_ids"], a["labels"]) if lab == -100]
        for answer in (a, b):
            tail = [t for t, lab in zip(answer["input_ids"], answer["labels"]) if lab != -100]
            out.append({"input_ids": prompt + tail, "labels": [-100] * len(prompt) + tail})
    return out


def fused_step(model, batch, kernel, count):
    model.zero_grad(set_to_none=True)
    patch = fl.patch_model(model)
    patch.kernel = kernel
    try:
        model.train()
        loss = model(**batch, num_items_in_batch=torch.tensor(count)).loss
        loss.backward()
    finally:
        patch.remove()
    return loss.detach(), grads(model)


def reference_step(model, examples, label_smoothing=0.0, packed=None):
    model.zero_grad(set_to_none=True)
    total, count = by_hand(model, examples, label_smoothing, packed)
    (total / count).backward()
    return (total / count).detach(), grads(model), count


def test_two_kernels_run_on_this_cpu():
    assert len(HERE) >= 2 and HERE[-1] == "chunked" and "torch" in HERE


@pytest.mark.parametrize("kernel", HERE)
@pytest.mark.parametrize("layout", ["padded", "padding_free", "pairs"])
def test_kernel_matches_the_reference(kernel, layout):
    model = tiny_llama()  # SDPA keeps float64 (eager's softmax runs in float32); dropout 0: train mode is deterministic
    examples = lm_examples(8, seed=3)
    if layout == "pairs":
        examples = pairs(examples)
    batch = padding_free(examples) if layout == "padding_free" else padded(examples)
    packed = {k: batch[k] for k in ("input_ids", "position_ids")} if layout == "padding_free" else None
    want_loss, want, count = reference_step(model, examples, packed=packed)
    got_loss, got = fused_step(model, batch, kernel, count)
    assert float((got_loss - want_loss).abs() / want_loss) <= TOL
    assert want.keys() == got.keys() and rel(got, want) <= TOL


@pytest.mark.parametrize("kernel", HERE)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_the_seam_sums_counted_tokens(kernel, label_smoothing):
    """`kernels.token_loss` alone: rows labelled -100 dropped, the sum and the count returned, gradients of the
    hidden states, the weight and the bias exact; label smoothing computed or refused by name."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(101, 16, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(101, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 101, (37,), generator=g)
    y[::3] = -100
    if label_smoothing and "label_smoothing" not in kernels.get(kernel).SETTINGS:
        with pytest.raises(ValueError, match=f"loss kernel '{kernel}' does not compute label smoothing"):
            kernels.token_loss(kernel, h, w, b, y, label_smoothing=label_smoothing)
        return
    total, count = kernels.token_loss(kernel, h, w, b, y, label_smoothing=label_smoothing)
    total.backward()
    got = [t.grad.clone() for t in (h, w, b)]
    for t in (h, w, b):
        t.grad = None
    keep = y != -100
    logits = h[keep] @ w.T + b
    logp = logits - logits.logsumexp(-1, keepdim=True)
    want = ((1 - label_smoothing) * -logp.gather(1, y[keep].unsqueeze(1)).squeeze(1)
            + label_smoothing * -logp.mean(-1)).sum()
    want.backward()
    assert int(count) == int(keep.sum()) and float((total - want).abs() / want) <= TOL
    assert all(float((a - t.grad).norm() / t.grad.norm()) <= TOL for a, t in zip(got, (h, w, b)))


@pytest.mark.parametrize("name, package", [("liger", "liger-kernel"), ("cut_ce", "cut-cross-entropy")])
def test_cuda_kernels_are_registered_with_their_rule(name, package):
    """Without their package or CUDA they do not run here, and say why in one line naming the fix."""
    why = kernels.unavailable(name, "cpu", torch.bfloat16)
    assert why is not None and name not in HERE
    assert f"pip install {package}" in why or "CUDA only" in why
    memory = kernels.get(name).memory(4096, 2048, 128256, 2)
    assert memory.peak > 0


def test_torch_kernel_is_refused_for_bf16():
    assert "rounds the token-loss sum" in kernels.unavailable("torch", "cpu", torch.bfloat16)
    assert kernels.runnable("cpu", torch.bfloat16) == ["chunked"]
    assert kernels.default("cpu", torch.float32) == "torch" and kernels.default("cpu", torch.bfloat16) == "chunked"


@pytest.mark.parametrize("measured, budget, chosen", [
    ({"torch": (1.0, 100), "chunked": (2.0, 100)}, 100, "torch"),     # the fastest
    ({"torch": (1.0, 200), "chunked": (2.0, 100)}, 150, "chunked"),   # the fastest that fits
    ({"torch": (1.0, 200), "chunked": (2.0, 300)}, 150, "torch"),     # none fits: the kernel the search ran with
    ({"torch": (1.0, 100), "chunked": (1.0, 100)}, 100, "torch"),     # a tie: the library's, registered first
    ({"chunked": (3.0, 10)}, 100, "chunked"),
])
def test_choose_is_the_fastest_that_fits(measured, budget, chosen):
    assert kernels.choose(measured, budget, "torch") == chosen


def test_forced_kernel_that_cannot_run_is_one_error():
    model = tiny_llama(dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="loss kernel 'torch' cannot run here: it returns the loss in the input"):
        fused_step(copy.deepcopy(model), padded(lm_examples(2)), "torch", 10)
