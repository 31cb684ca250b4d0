"""Checkpointing k of L decoder layers never changes the gradient: float64, dropout on (the RNG replayed by
torch.utils.checkpoint's preserve_rng_state), against the same model without checkpointing, the loss computed by hand.
For a causal LM, LoRA (frozen embeddings: reentrant checkpointing needs the input-embedding hook) and a padding-free
batch (DataCollatorWithFlattening)."""

import pytest
import torch
from transformers import DataCollatorWithFlattening

from hf_accum.compat import gradient_checkpointing
from tests.exactness import lm_examples, pad_collate, tiny_llama

LAYERS = 3


def dropout_llama():
    return tiny_llama(num_hidden_layers=LAYERS, attention_dropout=0.3)


def lora_llama(dropout=0.3):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(dropout_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=dropout, init_lora_weights=False))


def hand_loss(logits, labels):
    """Mean token cross-entropy over every counted next-token label, by hand in float64."""
    logits, labels = logits[:, :-1].double(), labels[:, 1:]
    logp = logits.log_softmax(-1)
    mask = labels.ne(-100)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(picked * mask).sum() / mask.sum()


def grads(model, batch, seed=0):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    # use_cache=False as the Trainer trains (it sets config.use_cache = args.use_cache, False): with a cache, transformers
    # 5.24 masks a padding-free row as one causal sequence, not per packed sequence
    inputs = {"use_cache": False, **{k: v for k, v in batch.items() if k != "labels"}}
    hand_loss(model(**inputs).logits, batch["labels"]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel_error(got, want):
    assert got.keys() == want.keys()
    num = sum(float((got[n] - want[n]).pow(2).sum()) for n in want)
    den = sum(float(want[n].pow(2).sum()) for n in want)
    return (num / den) ** 0.5


def padded_batch():
    return pad_collate(lm_examples(6, seed=3))


def flat_batch():
    rows = [{"input_ids": e["input_ids"]} for e in lm_examples(6, seed=4)]
    return DataCollatorWithFlattening(return_tensors="pt")(rows)


@pytest.mark.parametrize("k", [1, 2, LAYERS])
@pytest.mark.parametrize("reentrant", [False, True])
def test_causal_lm_gradients_equal_with_k_layers(k, reentrant):
    model, batch = dropout_llama(), padded_batch()
    want = grads(model, batch)
    assert rel_error(grads(model, batch, seed=1), want) > 1e-3  # dropout really is on: another seed differs
    with gradient_checkpointing.checkpointed_layers(model, k, {"use_reentrant": reentrant}):
        assert gradient_checkpointing.checkpointed_count(model) == k
        got = grads(model, batch)
    assert gradient_checkpointing.checkpointed_count(model) == 0
    assert rel_error(got, want) <= 1e-12


def test_the_rng_replay_is_what_makes_it_exact():
    # the negative control: without preserve_rng_state the recompute draws other dropout masks
    model, batch = dropout_llama(), padded_batch()
    want = grads(model, batch)
    with gradient_checkpointing.checkpointed_layers(model, LAYERS, {"use_reentrant": False, "preserve_rng_state": False}):
        got = grads(model, batch)
    assert rel_error(got, want) > 1e-6


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("k", [1, LAYERS])
def test_lora_gradients_equal_with_k_layers(k, reentrant):
    model, batch = lora_llama(), padded_batch()
    want = grads(model, batch)
    assert want and all("lora_" in n for n in want)
    with gradient_checkpointing.checkpointed_layers(model, k, {"use_reentrant": reentrant}):
        got = grads(model, batch)
    assert rel_error(got, want) <= 1e-12


def test_lora_reentrant_needs_the_input_embedding_hook():
    """The hook transformers' enable installs is what lets a frozen embedding's output carry the gradient into a
    reentrant checkpoint: without it no adapter gets a gradient (every layer checkpointed: the loss has no graph)."""
    model, batch = lora_llama(dropout=0.0), padded_batch()
    with gradient_checkpointing.checkpointed_layers(model, LAYERS, {"use_reentrant": True}):
        assert gradient_checkpointing.checkpoint_owner(model)._require_grads_hooks  # installed by transformers' enable
        assert rel_error(grads(model, batch), grads_without_checkpointing(batch)) <= 1e-12
        gradient_checkpointing.checkpoint_owner(model).disable_input_require_grads()
        with pytest.warns(UserWarning, match="requires_grad"), pytest.raises(RuntimeError, match="require grad"):
            grads(model, batch)


def grads_without_checkpointing(batch):
    return grads(lora_llama(dropout=0.0), batch)


@pytest.mark.parametrize("k", [1, LAYERS])
def test_padding_free_gradients_equal_with_k_layers(k):
    model, batch = dropout_llama(), flat_batch()
    assert batch["input_ids"].shape[0] == 1 and int((batch["position_ids"] == 0).sum()) == 6
    want = grads(model, batch)
    with gradient_checkpointing.checkpointed_layers(model, k):
        got = grads(model, batch)
    assert rel_error(got, want) <= 1e-12


def test_padding_free_checkpointed_equals_each_sequence_alone():
    """Without dropout, the checkpointed flattened row against each sequence forwarded alone (no checkpointing)."""
    model, batch = tiny_llama(num_hidden_layers=LAYERS), flat_batch()
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
    model.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for a, b in zip(starts[:-1], starts[1:]):
        labels = batch["labels"][:, a:b]
        logits = model(input_ids=batch["input_ids"][:, a:b]).logits
        count += int(labels[:, 1:].ne(-100).sum())
        total = total + hand_loss(logits, labels) * int(labels[:, 1:].ne(-100).sum())
    (total / count).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    with gradient_checkpointing.checkpointed_layers(model, 2):
        got = grads(model, batch)
    assert rel_error(got, want) <= 1e-12


def test_the_context_restores_an_enabled_model():
    model = dropout_llama()
    gradient_checkpointing.set_checkpointed_layers(model, LAYERS, {"use_reentrant": False})
    funcs = [layer._gradient_checkpointing_func for layer in gradient_checkpointing.checkpointable_layers(model)]
    with gradient_checkpointing.checkpointed_layers(model, 1):
        assert [layer.gradient_checkpointing for layer in gradient_checkpointing.checkpointable_layers(model)] == [True, False, False]
    assert gradient_checkpointing.checkpointed_count(model) == LAYERS
    assert [layer._gradient_checkpointing_func for layer in gradient_checkpointing.checkpointable_layers(model)] == funcs
    with gradient_checkpointing.checkpointed_layers(model, 0):
        assert gradient_checkpointing.checkpointed_count(model) == 0
    assert gradient_checkpointing.checkpointed_count(model) == LAYERS
