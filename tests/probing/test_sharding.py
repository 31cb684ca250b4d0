"""One rank's bytes under FSDP2 and ZeRO-1/2/3, counted by hand from the shapes (`probing/sharding.py`), and the
grid's pure parts (`probing/fits_sharded.py`): the largest micro-batch, the fewest GPUs, a cell's plan."""

import pytest

from hf_accum.probing.fits_sharded import cell_text, cells_for, fewest_gpus, largest, plan_text
from hf_accum.probing.sharding import (
    Counts,
    Param,
    Sharding,
    deepspeed_model_states,
    from_deepspeed,
    parse_sharding,
    rank_bytes,
    rank_peak,
)


@pytest.mark.parametrize("shape, world, expected", [
    ((10, 4), 4, 12),  # dim 0 padded to 12: a rank holds 3 rows of 4
    ((8, 4), 2, 16),
    ((7,), 2, 4),
    ((), 8, 1),
])
def test_a_shard_is_dim_0_padded_to_the_world(shape, world, expected):
    assert Param(shape, 4, True).shard_numel(world) == expected


def _two_layers(trainable=True, root_trainable=True):
    layer = (Param((8, 4), 4, trainable), Param((4,), 4, trainable))  # 32 + 4 elements, 144 bytes
    return Counts((layer, layer), (Param((16, 4), 4, root_trainable),))  # root: 64 elements, 256 bytes


@pytest.mark.parametrize("sharding, world, expected", [
    # weights 2 x (64 + 8) + 128 (halves); gradients as much; AdamW's two moments twice that;
    # gathered: the root (256) and the layer whose backward runs first (144); buffers: a layer's unsharded
    # gradients, the reduce-scatter's flat input (2 x 144) and its output shard (72)
    ("fsdp2", 2, dict(weights=272, gradients=272, optimizer=544, gathered=400, gradient_buffers=360)),
    ("fsdp2-keep", 2, dict(weights=272, gradients=272, optimizer=544, gathered=544, gradient_buffers=360)),
    # world 4: the (4,) norm's shard is 1 element; the (8, 4) weight's 2 rows
    ("fsdp2", 4, dict(weights=2 * (32 + 4) + 64, gradients=136, optimizer=272, gathered=400,
                      gradient_buffers=288 + 36)),
])
def test_fsdp2_rank_bytes_by_hand(sharding, world, expected):
    rb = rank_bytes(_two_layers(), parse_sharding(sharding), world)
    assert {k: getattr(rb, k) for k in expected} == expected


def test_a_frozen_base_holds_no_gradients_and_no_optimizer_state():
    # LoRA: the base frozen, only the root trainable here
    rb = rank_bytes(_two_layers(trainable=False), parse_sharding("fsdp2"), 2)
    assert (rb.weights, rb.gradients, rb.optimizer) == (272, 128, 256)
    assert rb.gradient_buffers == 0  # no layer has a gradient to reduce
    zero = rank_bytes(_two_layers(trainable=False), parse_sharding("zero2"), 2)
    assert zero.gradients == 4 * 32 and zero.optimizer == 12 * 32  # 64 trainable elements, 32 a rank, fp32 states


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("stage, offload", [(2, False), (2, True)])
def test_zero2_model_states_are_deepspeeds_per_parameter_formula(world, stage, offload):
    # bf16 weights, all trainable: 2P + 18P/N (offload: 2P on the card, 16P/N on CPU)
    counts = Counts((), (Param((4096, 16), 2, True),))
    p = 4096 * 16
    rb = rank_bytes(counts, Sharding(f"zero{stage}", offload_optimizer=offload), world)
    assert rb.resident == deepspeed_model_states(p, p, world, stage, offload)
    assert rb.cpu == (16 * p // world if offload else 0)


def test_deepspeeds_own_estimators_agree_with_the_formula_written_out():
    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    p, largest_layer = 8_030_261_248, 525_336_576  # Llama-3-8B; its embedding the largest layer
    for world in (1, 2, 4, 8):
        for offload in (False, True):
            assert stage_1_and_2.estimate_zero2_model_states_mem_needs(p, world, 1, offload)[1] == \
                deepspeed_model_states(p, largest_layer, world, 2, offload)
            assert stage3.estimate_zero3_model_states_mem_needs(p, largest_layer, world, 1, offload, False)[1] == \
                deepspeed_model_states(p, largest_layer, world, 3, offload)


def test_zero3_partitions_the_weights_and_keeps_small_ones_whole():
    counts = Counts((), (Param((4096, 16), 2, True), Param((64,), 2, True)))
    p = 4096 * 16 + 64
    rb = rank_bytes(counts, Sharding("zero3", persistence_threshold=64), 4)
    # every weight's partition, and the (64,) norm whole on every rank (DeepSpeed's persistent weights)
    assert rb.weights == 2 * p // 4 + 2 * 64 and rb.gradients == 2 * p // 4 and rb.optimizer == 16 * p // 4
    # DeepSpeed's default threshold (1e5 elements): both weights persistent, nothing left to gather
    assert rank_bytes(counts, Sharding("zero3"), 4).weights == 2 * p // 4 + 2 * p
    assert rank_bytes(counts, Sharding("zero3"), 4).gathered == 0
    zero1 = rank_bytes(counts, Sharding("zero1"), 4)
    assert zero1.weights == zero1.gradients == 2 * p  # ZeRO-1 partitions the optimizer state only


def test_zero3_gathers_what_its_reuse_distance_keeps_else_the_largest_unit_with_the_prefetch_bucket():
    layer = (Param((1024, 16), 2, True),)  # 16384 elements, 32 KiB
    counts = Counts((layer, layer), (Param((64,), 2, True),))
    gathered = {k: rank_bytes(counts, Sharding("zero3", persistence_threshold=64, prefetch_bucket_size=10, **kw),
                              4).gathered for k, kw in {
        "default": {},  # every weight used again within 1e9 elements: kept from its forward to its backward
        "released": {"max_reuse_distance": 0},  # released after its module: the layer running and the prefetch
        "last kept": {"max_reuse_distance": 1000},  # the last layer's forward and backward 2 x 64 elements apart
        "live cap": {"max_live_parameters": 20_000}}.items()}
    assert gathered == {"default": 2 * 2 * 16384, "released": 2 * (16384 + 10), "last kept": 2 * 16384 + 2 * 16384,
                        "live cap": 2 * 20_000}


def test_zero3_settings_from_a_deepspeed_config():
    s = from_deepspeed({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 640,
                                              "stage3_max_live_parameters": "auto", "stage3_max_reuse_distance": 0}})
    assert (s.persistence_threshold, s.max_live_parameters, s.max_reuse_distance) == (640, 1_000_000_000, 0)


def test_counts_know_the_embeddings_run_before_the_decoder_layers():
    import torch
    from transformers import LlamaForCausalLM

    from hf_accum.probing.paper_sharded import counts_of
    from tests.workers.sharded_estimate_worker import small_llama_config

    with torch.device("meta"):
        counts = counts_of(LlamaForCausalLM(small_llama_config()))
    assert counts.leading == 1 and counts.root[0].shape == (512, 64)  # embed_tokens; then the norm and the head
    assert [p.shape for p in counts.root[1:]] == [(64,), (512, 64)]


@pytest.mark.parametrize("text, expected", [
    ("fsdp2", Sharding("fsdp2")),
    ("FSDP2-keep", Sharding("fsdp2", reshard_after_forward=False)),
    ("zero3+offload", Sharding("zero3", offload_optimizer=True)),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 2e8,
                            "allgather_bucket_size": "auto"}},
     Sharding("zero2", offload_optimizer=True, reduce_bucket_size=200_000_000)),
])
def test_a_sharding_from_its_name_or_a_deepspeed_config(text, expected):
    assert parse_sharding(text) == expected


@pytest.mark.parametrize("text, words", [
    ("ddp", "sharding='ddp': give one of fsdp2, zero1"),
    ("fsdp2+offload", "DeepSpeed's optimizer offload only"),
])
def test_a_sharding_not_modelled_is_refused_by_name(text, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("+", r"\+")):
        parse_sharding(text)
    with pytest.raises(ValueError, match="stage is 0"):
        from_deepspeed({"zero_optimization": {"stage": 0}})


def test_a_ranks_peak_is_the_larger_of_backward_and_the_optimizer_step():
    counts = _two_layers()
    s = parse_sharding("fsdp2")
    rb = rank_bytes(counts, s, 2)
    assert rank_peak(counts, s, 2, 1000, 0) == rb.resident + 1000 + rb.gathered + rb.gradient_buffers
    assert rank_peak(counts, s, 2, 0, 10**6) == rb.resident + 10**6 // 2  # AdamW's temporaries on the shard


def test_zero2s_gradient_partition_and_bucket_are_live_from_the_first_gradient_to_the_step():
    counts = _two_layers()
    s = parse_sharding("zero2")
    rb = rank_bytes(counts, s, 2)
    late = rb.gradients + rb.gradient_buffers  # allocated at a backward's first gradient, freed by the step
    assert rb.between_steps == rb.resident - rb.gradients
    # the first gradient unknown: counted as at the activations' peak
    assert rank_peak(counts, s, 2, 10**6, 0) == rb.between_steps + 10**6 + late
    # the activations' peak well before the first gradient: nothing of them on top
    assert rank_peak(counts, s, 2, 10**6, 0, first_gradient=1000) == rb.between_steps + 10**6
    assert rank_peak(counts, s, 2, 10**6, 0, first_gradient=10**6 - 100) == rb.between_steps + 10**6 - 100 + late
    # ZeRO-1 and ZeRO-3 hold theirs between steps: the first gradient changes nothing
    for name in ("zero1", "zero3"):
        z = parse_sharding(name)
        assert rank_peak(counts, z, 2, 10**6, 0, first_gradient=0) == rank_peak(counts, z, 2, 10**6, 0)


# --- the grid's pure parts -------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget, cap, guess, expected, stepped", [
    (55, 32, 5, 5, {1, 5, 6}),  # guessed right: the answer and the size above it stepped
    (55, 32, 9, 5, {1, 9, 8, 7, 6, 5}),  # guessed high: down until it fits
    (55, 32, 2, 5, {1, 2, 3, 4, 5, 6}),  # guessed low: up until the next does not fit
    (55, 4, 9, 4, {1, 4}),  # the cap fits
    (5, 32, 3, 0, {1}),  # micro-batch 1 does not fit
])
def test_the_largest_micro_batch_is_stepped_not_read_off_a_line(budget, cap, guess, expected, stepped):
    seen = set()

    def peak(m):
        seen.add(m)
        return 10 * m + 5

    assert largest(peak, budget, cap, guess) == expected
    assert seen == stepped


def test_the_fewest_gpus_that_fit():
    assert fewest_gpus(lambda w: 100 / w <= 20) == 8
    assert fewest_gpus(lambda w: False) is None


def test_a_cell_names_the_plan_or_the_fewest_gpus():
    counts = Counts(((Param((1024, 1024), 2, True),),) * 4, (Param((4096, 1024), 2, True),))
    acts = {None: lambda m: 3_000_000 * m, "all": lambda m: 1_000_000 * m}
    opt = {None: 0, "all": 0}
    s = parse_sharding("fsdp2")
    cells = cells_for(counts, s, acts, opt, seq_len=512, cards=[60_000_000], gpus=[1, 2, 4], fraction=1.0,
                      target=32, max_micro=None)
    for cell in cells:  # each answer checked against every size by brute force
        fits = [m for m in range(1, 32 // cell.gpus + 1) if rank_peak(counts, s, cell.gpus, acts[None](m), 0) <= 60e6]
        if fits:
            assert cell.micro_batch == max(fits) and cell.checkpointing == "none"
    one = cells[0]  # 1 GPU: 16 + 16 + 32 MiB of weights, gradients and moments alone; 2 GPUs hold half of them
    assert not one.fits and one.fewest_gpus == 2 and cell_text(one) == "does not fit (2 GPUs would)"
    assert cells[1].fits and cell_text(cells[1]) == f"{cells[1].micro_batch}: {cells[1].plan}"
    assert plan_text(32, 2, 5) == "4 × 4 × 2 = 32"  # 16 a rank in the fewest forwards: 4 of 4
