"""Selective checkpointing (hf_accum/levers/selective.py) never changes the gradient and saves less for the backward than no
checkpointing, more than full: float64, dropout on, against the same model without checkpointing, the loss by hand.
For a causal LM, LoRA and a padding-free batch (the cases of test_checkpoint_layers.py)."""

import pytest
import torch

from hf_accum.compat import gradient_checkpointing
from hf_accum.levers import selective
from tests.exactness import tiny_llama
from tests.levers.test_checkpoint_layers import (
    LAYERS,
    dropout_llama,
    flat_batch,
    grads,
    lora_llama,
    padded_batch,
    rel_error,
)


@pytest.mark.parametrize("full, sel", [(0, 1), (0, LAYERS), (1, 2)])
@pytest.mark.parametrize("build, batch", [(dropout_llama, padded_batch), (lora_llama, padded_batch),
                                          (dropout_llama, flat_batch)], ids=["lm", "lora", "padding_free"])
def test_gradients_equal_without_checkpointing(build, batch, full, sel):
    model, data = build(), batch()
    want = grads(model, data)
    assert rel_error(grads(model, data, seed=1), want) > 1e-3  # dropout really is on
    with selective.layer_levels(model, full, sel):
        assert (gradient_checkpointing.checkpointed_count(model), selective.selective_count(model)) == (full + sel, sel)
        got = grads(model, data)
    assert (gradient_checkpointing.checkpointed_count(model), selective.selective_count(model)) == (0, 0)
    assert rel_error(got, want) <= 1e-12


def peak_bytes(model, data) -> int:
    """Peak tensor bytes of one forward + backward (CpuMeter: the profiler's allocation events, to the byte)."""
    from hf_accum.probing.meters import CpuMeter

    model.train()
    inputs = {"use_cache": False, **{k: v for k, v in data.items() if k != "labels"}}
    return CpuMeter().measure(lambda: model(**inputs).logits.sum().backward()).peak_bytes


def test_the_selective_level_peaks_between_none_and_full():
    model = tiny_llama(torch.float32, num_hidden_layers=4, hidden_size=64, intermediate_size=256, max_position_embeddings=256)
    data = {"input_ids": torch.randint(3, 60, (4, 256)), "attention_mask": torch.ones(4, 256, dtype=torch.long)}
    model.zero_grad(set_to_none=False)
    none = peak_bytes(model, data)
    with selective.layer_levels(model, 0, 4):
        sel = peak_bytes(model, data)
    with gradient_checkpointing.checkpointed_layers(model, 4, {"use_reentrant": False}):
        full = peak_bytes(model, data)
    assert full < sel < none, (full, sel, none)


def test_it_refuses_reentrant_and_too_many_layers():
    model = dropout_llama()
    with pytest.raises(ValueError, match="use_reentrant=True"):
        selective.set_layer_levels(model, 0, 1, {"use_reentrant": True})
    with pytest.raises(ValueError, match=f"has {LAYERS} per-layer"):
        selective.set_layer_levels(model, 2, 2)
    assert gradient_checkpointing.checkpointed_count(model) == 0


def test_the_context_restores_the_layers_as_they_were():
    model = dropout_llama()
    gradient_checkpointing.set_checkpointed_layers(model, 1, {"use_reentrant": False})
    before = [(layer.gradient_checkpointing, layer._gradient_checkpointing_func)
              for layer in gradient_checkpointing.checkpointable_layers(model)]
    with selective.layer_levels(model, 1, 2):
        assert selective.selective_count(model) == 2
    assert [(layer.gradient_checkpointing, layer._gradient_checkpointing_func)
            for layer in gradient_checkpointing.checkpointable_layers(model)] == before
