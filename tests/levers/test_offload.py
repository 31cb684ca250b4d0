"""Activation offload (hf_accum.levers.activation_offload) never changes the gradient, touches only the layers it is given, leaves the
model as it was, and skips the layers that are checkpointed when they run: float64, dropout on, against the same model
without offload, the loss by hand (the helpers of test_checkpoint_layers.py). For a causal LM, LoRA and a padding-free
batch. On CPU `save_on_cpu` would keep a CPU tensor as it is, so a spy stands in for its pack and unpack and makes a
real copy of every tensor: the gradient then is computed from the copies."""

import pytest
import torch

from hf_accum.compat import gradient_checkpointing
from hf_accum.levers import activation_offload as offload
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


class CopySpy:
    """Stands in for `save_on_cpu`: every packed tensor is copied (a new storage) and counted."""

    def __init__(self):
        self.packed, self.unpacked = [], 0

    def __call__(self, pin_memory=False):
        assert pin_memory is False  # the CPU tests ask for no pinning
        spy = self

        class Hooks:
            def pack_hook(self, tensor):
                spy.packed.append(tensor.untyped_storage().data_ptr())
                return tensor.device, tensor.detach().clone()

            def unpack_hook(self, packed):
                spy.unpacked += 1
                device, tensor = packed
                return tensor.to(device)

        return Hooks()


@pytest.fixture
def spy(monkeypatch):
    spy = CopySpy()
    monkeypatch.setattr(offload, "save_on_cpu", spy)
    return spy


def param_storages(model):
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


@pytest.mark.parametrize("indices", [[0], [1, 2], list(range(LAYERS))])
@pytest.mark.parametrize("build, batch", [(dropout_llama, padded_batch), (lora_llama, padded_batch),
                                          (dropout_llama, flat_batch)], ids=["lm", "lora", "padding_free"])
def test_gradients_equal_without_offload(spy, build, batch, indices):
    model, data = build(), batch()
    want = grads(model, data)
    assert rel_error(grads(model, data, seed=1), want) > 1e-3  # dropout really is on
    assert not spy.packed  # nothing offloaded without the lever
    with offload.offloaded_layers(model, indices, pin_memory=False):
        assert offload.offloaded_indices(model) == indices
        got = grads(model, data)
    assert offload.offloaded_indices(model) == []
    assert spy.packed and spy.unpacked == len(spy.packed)  # saved tensors went out and came back, each once
    assert not set(spy.packed) & param_storages(model)  # weights stay where they are
    assert rel_error(got, want) <= 1e-12


def test_only_the_chosen_layers_are_offloaded(spy):
    model, data = dropout_llama(), padded_batch()
    counts = {}
    for indices in ([0], [1], [0, 1]):
        spy.packed.clear()
        with offload.offloaded_layers(model, indices, pin_memory=False):
            grads(model, data)
        counts[tuple(indices)] = len(spy.packed)
    assert counts[(0,)] > 0 and counts[(0,)] == counts[(1,)]  # identical layers save the same tensors
    assert counts[(0, 1)] == 2 * counts[(0,)]


def test_a_checkpointed_layer_is_not_offloaded(spy):
    """Layers 0 (full) and 1 (selective) checkpointed, all three offloaded: only layer 2 packs, and it is exact."""
    model, data = dropout_llama(), padded_batch()
    want = grads(model, data)
    with offload.offloaded_layers(model, [2], pin_memory=False):
        grads(model, data)
    alone = len(spy.packed)
    spy.packed.clear()
    with selective.layer_levels(model, 1, 1), offload.offloaded_layers(model, range(LAYERS), pin_memory=False):
        assert gradient_checkpointing.checkpointed_count(model) == 2
        got = grads(model, data)
    assert len(spy.packed) == alone > 0
    assert rel_error(got, want) <= 1e-12


def state(model):
    layers = gradient_checkpointing.checkpointable_layers(model)
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [(sorted(layer.__dict__), getattr(layer.forward, "__func__", layer.forward)) for layer in layers])


def test_apply_and_remove_leave_the_model_as_it_was():
    model, data = dropout_llama(), padded_batch()
    before_tensors, before_layers = state(model)
    model.eval()
    inputs = {k: v for k, v in data.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**inputs).logits
    offload.set_offloaded_layers(model, [0, 2], pin_memory=False)
    assert offload.offloaded_indices(model) == [0, 2]
    assert state(model)[1] != before_layers  # the layers really were wrapped
    offload.set_offloaded_layers(model, [])
    after_tensors, after_layers = state(model)
    assert after_layers == before_layers and after_tensors.keys() == before_tensors.keys()
    assert all(torch.equal(after_tensors[k], v) for k, v in before_tensors.items())
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, logits)
    with pytest.raises(RuntimeError, match="boom"), offload.offloaded_layers(model, [1], pin_memory=False):
        raise RuntimeError("boom")  # an error in the block (an OOM in a probe trial) restores the layers too
    assert offload.offloaded_indices(model) == [] and state(model)[1] == before_layers


def test_setting_again_replaces_and_a_trial_restores_the_plan(spy):
    """A plan applied twice wraps no layer twice; a probe trial inside it leaves the plan's layers as they were."""
    model, data = dropout_llama(), padded_batch()
    before = state(model)[1]
    offload.set_offloaded_layers(model, [1], pin_memory=False)
    grads(model, data)
    once = len(spy.packed)
    offload.set_offloaded_layers(model, [1], pin_memory=False)
    spy.packed.clear()
    grads(model, data)
    assert len(spy.packed) == once > 0
    offload.set_offloaded_layers(model, [])
    assert state(model)[1] == before  # one removal undoes it: it was not wrapped twice
    offload.set_offloaded_layers(model, [1], pin_memory=False)
    with offload.offloaded_layers(model, [0, 2], pin_memory=False):
        assert offload.offloaded_indices(model) == [0, 2]
    assert offload.offloaded_indices(model) == [1]
    offload.set_offloaded_layers(model, [0, 1], pin_memory=False)
    assert offload.offloaded_indices(model) == [0, 1]


def test_it_refuses_bad_indices_before_touching_the_model():
    model = dropout_llama()
    offload.set_offloaded_layers(model, [1], pin_memory=False)
    for bad in ([LAYERS], [-1], [0, 0], [True]):
        with pytest.raises(ValueError, match=f"has {LAYERS} decoder layers"):
            offload.set_offloaded_layers(model, bad)
        with pytest.raises(ValueError, match=f"has {LAYERS} decoder layers"), offload.offloaded_layers(model, bad):
            pass
    assert offload.offloaded_indices(model) == [1]  # the refused calls touched nothing


@pytest.mark.parametrize("L, full, sel, off, want", [
    (4, 0, 0, 4, [0, 1, 2, 3]), (4, 1, 1, 2, [2, 3]), (16, 8, 0, 4, [8, 9, 10, 11]), (4, 2, 2, 0, []),
])
def test_layout_follows_the_checkpointed_layers(L, full, sel, off, want):
    assert offload.layout(L, full, sel, off) == want


@pytest.mark.parametrize("args", [(4, 2, 2, 1), (4, -1, 0, 1), (2, 0, 0, 3)])
def test_layout_refuses_more_layers_than_the_model_has(args):
    with pytest.raises(ValueError, match=f"has {args[0]} decoder layers"):
        offload.layout(*args)


def test_cpu_has_no_offload_and_says_why_in_one_line():
    assert offload.available("cpu") is False
    why = offload.why_unavailable(torch.device("cpu"))
    assert "\n" not in why and "CUDA only" in why and "cpu" in why
    if not torch.cuda.is_available():
        assert offload.available("cuda") is False and "not available" in offload.why_unavailable("cuda")


@pytest.mark.gpu
def test_on_cuda_offload_lowers_the_peak_and_keeps_the_gradient():
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = tiny_llama(torch.float32, num_hidden_layers=4, hidden_size=256, intermediate_size=1024,
                       max_position_embeddings=1024).to(device)
    data = {"input_ids": torch.randint(3, 60, (8, 1024), device=device)}
    data["labels"] = data["input_ids"].clone()
    assert offload.available(device)

    def run():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        got = grads(model, data)
        torch.cuda.synchronize()
        return got, torch.cuda.max_memory_allocated(device)

    run()  # warm-up: kernels and workspaces
    want, plain = run()
    with offload.offloaded_layers(model, range(4)):
        got, offloaded = run()
    assert offloaded < 0.8 * plain, (offloaded, plain)
    assert rel_error(got, want) <= 1e-6
