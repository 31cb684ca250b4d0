"""probe.py: exact trials against a fake meter; a real tiny Llama on CPU is probed without a trace."""

from __future__ import annotations

import copy
import os
import random
import tempfile

import numpy as np
import pytest
import torch

from hf_accum.probing.loop import NothingFitsError, agree_max_micro_batch, agree_on_rates, probe_micro_batches
from hf_accum.probing.meters import CpuMeter, FakeMeter, live_tensor_bytes
from hf_accum.probing.plan import divisors, forward_breakpoints, plan_batch
from hf_accum.probing.preserve import fresh_optimizer_like, preserved
from hf_accum.probing.probe import make_step_fn, probe_model, random_token_batch
from tests.exactness import probe_llama

# One xdist worker runs these tests (--dist loadgroup): `probed` is built once, not on each.
pytestmark = pytest.mark.xdist_group("test_probe")

MiB = 1 << 20
SEQ = 32

class Recorder:
    """A step_fn that records the sizes it ran (the warm-up included)."""

    def __init__(self, oom_from: int | None = None):
        self.ran: list[int] = []
        self.oom_from = oom_from

    def __call__(self, micro: int) -> None:
        if self.oom_from is not None and micro >= self.oom_from:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.ran.append(micro)


# --- exact trials with a fake meter ------------------------------------------------------------------------
# fmt: off
PROBE_TABLE = [
    # id, memory (bytes of micro), budget, target, sizes measured, max found, plan (micro, accum)
    ("linear", lambda m: 100 * MiB + 10 * MiB * m, 400 * MiB, 64, [1, 3, 30], 30, (22, 3)),
    ("fits-all", lambda m: 100 * MiB + 10 * MiB * m, 4000 * MiB, 64, [1, 36, 64], 64, (64, 1)),
    ("tight", lambda m: 100 * MiB + 10 * MiB * m, 135 * MiB, 48, [1, 2, 3], 3, (3, 16)),
    ("plateau", lambda m: max(200 * MiB, 100 * MiB + 10 * MiB * m), 400 * MiB, 64, [1, 2, 4, 8, 16, 34, 25, 30], 30, (22, 3)),
]
# fmt: on


@pytest.mark.parametrize(
    "memory, budget, target, expected_calls, expected_max, expected_plan",
    [row[1:] for row in PROBE_TABLE],
    ids=[row[0] for row in PROBE_TABLE],
)
def test_probe_with_a_fake_meter_tries_exactly(memory, budget, target, expected_calls, expected_max, expected_plan):
    meter = FakeMeter(memory, capacity_bytes=budget)  # over budget is an out-of-memory error
    step = Recorder()
    result = probe_micro_batches(step, meter, budget, target, must_resolve=forward_breakpoints(target))
    assert meter.calls == expected_calls
    assert step.ran[0] == 1 and step.ran[1:] == [t.micro_batch_size for t in result.trials if t.fits]  # warm-up first
    assert result.max_micro_batch_size == expected_max
    plan = plan_batch(target, 1, result.max_micro_batch_size)
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == expected_plan
    assert [t.micro_batch_size for t in result.trials] == expected_calls


def test_an_oom_raised_by_the_step_is_a_size_that_does_not_fit_and_the_probe_goes_on():
    meter = FakeMeter(lambda m: 100 * MiB + 10 * MiB * m, capacity_bytes=10**12)
    step = Recorder(oom_from=20)  # the step itself runs out of memory from 20 on
    result = probe_micro_batches(step, meter, 400 * MiB, 64, must_resolve=divisors(64))
    statuses = {t.micro_batch_size: t.status for t in result.trials}
    # the meter's formula says 30 fits, the step disagrees: bisection finds the step's own limit
    assert statuses == {
        1: "fits",
        3: "fits",
        30: "out of memory",
        16: "fits",
        23: "out of memory",
        19: "fits",
        21: "out of memory",
    }
    assert result.max_micro_batch_size == 19
    assert (result.next_size, result.next_verdict) == (32, "measured")


def test_errors_that_are_not_oom_propagate():
    def step(micro):
        if micro > 1:
            raise ValueError("a bug in the step")

    with pytest.raises(ValueError, match="a bug"):
        probe_micro_batches(step, FakeMeter(lambda m: m, 10**9), 10**6, 64)


def test_a_warmup_that_runs_out_of_memory_means_nothing_fits():
    result = probe_micro_batches(Recorder(oom_from=1), FakeMeter(lambda m: m, 10**9), 10**6, 8)
    assert result.max_micro_batch_size == 0 and result.trials[0].status == "out of memory"


def test_on_cpu_a_size_predicted_over_the_limit_is_refused_not_run():
    meter = FakeMeter(lambda m: 100 * MiB + 10 * MiB * m, capacity_bytes=10**12)
    meter.catches_oom = False  # play the CPU: running out of memory would kill the process
    step = Recorder()
    # budget above the limit, so the line's jump (to 90) would cross the limit (500 MiB, 40 samples)
    result = probe_micro_batches(step, meter, 1000 * MiB, 128, limit_bytes=500 * MiB)
    refused = [t.micro_batch_size for t in result.trials if t.status == "refused"]
    assert refused and not set(refused) & set(step.ran)
    assert all(100 * MiB + 10 * MiB * m <= 500 * MiB for m in step.ran)


def test_throughput_mode_times_the_fitting_divisors_and_takes_the_fastest():
    # per-sample time falls with the micro-batch up to 8, then rises (say, cache effects): 8 is fastest
    seconds = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.0, 16: 8.0}
    meter = FakeMeter(lambda m: 100 * MiB + 10 * MiB * m, 400 * MiB, seconds=lambda m: seconds.get(m, m / 4))
    result = probe_micro_batches(Recorder(), meter, 400 * MiB, 32, must_resolve=divisors(32), optimize="throughput")
    assert meter.calls == [1, 3, 30, 2, 4, 8, 16]  # the search, then the divisors not yet measured
    assert result.max_micro_batch_size == 30
    assert result.chosen_micro_batch_size == 8
    assert result.extra["samples_per_second"] == {1: 1.0, 2: 2 / 1.2, 4: 4 / 1.6, 8: 4.0, 16: 2.0}


# --- the real thing: a tiny Llama on CPU ----------------------------------------------------------------------
def _budget_for(model, micro_that_fits: float) -> int:
    """A budget that fits ``micro_that_fits`` samples, from two measured steps of a copy of the model."""
    clone = copy.deepcopy(model)
    opt = torch.optim.AdamW(clone.parameters())
    step = make_step_fn(clone, opt, random_token_batch(clone, SEQ))
    step(1)
    meter = CpuMeter(resident=lambda: live_tensor_bytes(clone, opt))
    p1, p2 = (meter.measure(lambda m=m: step(m)).peak_bytes for m in (1, 2))
    return int(p1 + (micro_that_fits - 1) * (p2 - p1))


@pytest.fixture(scope="module")
def probed():
    model = probe_llama()
    model.eval()  # the probe switches to train mode; it must switch back
    model.model.layers[0].train()  # a mixed state, restored module by module
    budget = _budget_for(model, 11.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    rng_before = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    flags_before = [m.training for m in model.modules()]
    result, plan = probe_model(model, seq_len=SEQ, target_batch_size=32, budget_bytes=budget)
    rng_after = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    return model, budget, before, rng_before, rng_after, flags_before, result, plan


def test_weights_are_bitwise_identical_after_the_probe(probed):
    model, _, before, *_ = probed
    after = model.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name


def test_rng_state_and_training_flags_are_unchanged(probed):
    model, _, _, rng_before, rng_after, flags_before, *_ = probed
    assert torch.equal(rng_before[0], rng_after[0])
    assert rng_before[1] == rng_after[1]
    assert all(np.array_equal(a, b) for a, b in zip(rng_before[2][1:3], rng_after[2][1:3]))
    assert [m.training for m in model.modules()] == flags_before


def test_no_gradients_or_optimizer_state_are_left_behind(probed):
    model, *_ = probed
    assert all(p.grad is None for p in model.parameters())
    # what the model holds is exactly its weights and buffers: no state hangs off it
    held = [*model.parameters(), *model.buffers()]
    assert live_tensor_bytes(model) == sum(t.numel() * t.element_size() for t in held)


def test_the_plan_cuts_the_window_into_the_fewest_forwards_that_fit(probed):
    _, budget, *_, result, plan = probed
    assert plan.gradient_accumulation_steps == -(-32 // result.max_micro_batch_size)
    assert plan.micro_batch_size == -(-32 // plan.gradient_accumulation_steps) <= result.max_micro_batch_size
    assert 10 <= result.max_micro_batch_size <= 12  # the budget was set for 11.5 samples
    assert plan.gradient_accumulation_steps > 1
    assert len(result.measured_trials) <= 4
    fitting = {t.micro_batch_size: t for t in result.trials if t.fits}
    assert result.max_micro_batch_size in fitting
    assert fitting[result.max_micro_batch_size].peak_bytes <= budget


def test_the_next_size_with_fewer_forwards_exceeds_the_budget(probed):
    model, budget, *_, result, plan = probed
    nxt = next(d for d in forward_breakpoints(32) if d > plan.micro_batch_size)
    assert result.next_size == nxt
    if result.next_verdict == "measured":  # it, or a smaller size, was run and did not fit
        assert any(not t.fits and t.micro_batch_size <= nxt for t in result.trials)
    else:  # predicted by the line: check the prediction, then check it for real
        assert result.next_verdict == "predicted"
        a, b = result.fitted
        assert a + b * nxt > budget
    clone = copy.deepcopy(model)
    opt = torch.optim.AdamW(clone.parameters())
    step = make_step_fn(clone, opt, random_token_batch(clone, SEQ))
    step(1)
    meter = CpuMeter(resident=lambda: live_tensor_bytes(clone, opt))
    assert meter.measure(lambda: step(nxt)).peak_bytes > budget


def test_peak_grows_with_the_micro_batch_across_trials(probed):
    *_, result, _ = probed
    measured = sorted((t.micro_batch_size, t.peak_bytes) for t in result.trials if t.peak_bytes is not None)
    assert len(measured) >= 2
    peaks = [p for _, p in measured]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)


def test_a_lora_model_is_probed_and_left_as_it_was():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(probe_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result, plan = probe_model(model, seq_len=SEQ, target_batch_size=8, budget_bytes=64 * MiB)
    assert plan.micro_batch_size == 8 and result.max_micro_batch_size == 8
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_the_callers_optimizer_is_copied_not_touched():
    model = probe_llama()
    real = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    probe_model(model, seq_len=SEQ, target_batch_size=4, budget_bytes=64 * MiB, optimizer=real)
    assert len(real.state) == 0
    fresh = fresh_optimizer_like(real)
    assert type(fresh) is torch.optim.SGD and fresh.param_groups[0]["momentum"] == 0.9 and fresh is not real


def test_preserved_restores_after_an_error():
    model = probe_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="boom"), preserved(model):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        torch.rand(3)
        raise RuntimeError("boom")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_existing_gradients_are_put_back_as_the_same_tensors():
    model = probe_llama()
    ids = torch.randint(0, 256, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: (p.grad, p.grad.clone()) for n, p in model.named_parameters()}
    with preserved(model):
        model(input_ids=ids, labels=ids).loss.backward()  # accumulates into the same tensors
    for n, p in model.named_parameters():
        assert p.grad is grads[n][0] and torch.equal(p.grad, grads[n][1])


# --- bad input ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"target_batch_size": 10, "world_size": 4}, r"not divisible by world_size=4.*8 or 12"),
        ({"seq_len": 65}, r"exceeds the model's max_position_embeddings=64"),
        ({"budget_bytes": 0}, r"budget_bytes=0 must be positive"),
        ({"budget_bytes": 1 << 60}, r"exceeds what this process can use"),
        ({"budget_fraction": 1.5}, r"budget_fraction=1.5 must be in \(0, 1\]"),
        ({"budget_bytes": MiB, "budget_fraction": 0.5}, r"either budget_bytes or budget_fraction"),
    ],
)
def test_bad_input_is_refused_before_any_step(kwargs, match):
    model = probe_llama()
    calls = []
    args = {"seq_len": SEQ, "target_batch_size": 8, "budget_bytes": 64 * MiB, **kwargs}
    if "budget_fraction" in kwargs and "budget_bytes" not in kwargs:
        args.pop("budget_bytes")
    with pytest.raises(ValueError, match=match):
        probe_model(model, make_batch=lambda m: calls.append(m), **args)
    assert calls == []


def test_a_model_that_does_not_fit_at_one_says_by_how_much_and_what_helps():
    model = probe_llama()
    with pytest.raises(NothingFitsError, match=r"over the budget.*gradient checkpointing.*LoRA.*4-bit") as info:
        probe_model(model, seq_len=SEQ, target_batch_size=8, budget_bytes=100_000)
    assert info.value.result.trials[0].micro_batch_size == 1 and not info.value.result.trials[0].fits


# --- data parallel -----------------------------------------------------------------------------------------
def _agree_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        agreed = agree_max_micro_batch([12, 7][rank])
        rates = agree_on_rates([{1: 10.0, 2: 20.0, 4: 30.0}, {1: 12.0, 2: 15.0}][rank])
        with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
            f.write(f"{agreed} {sorted(rates.items())}")
    finally:
        dist.destroy_process_group()


def test_all_ranks_adopt_the_smallest_maximum_and_the_slowest_rates():
    assert agree_max_micro_batch(12) == 12  # not distributed: unchanged
    with tempfile.TemporaryDirectory() as tmp:
        # fork: the children inherit the imported modules (spawn would re-import transformers, ~10 s each)
        torch.multiprocessing.start_processes(
            _agree_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, start_method="fork"
        )
        # the max: the smallest; the rates: the slowest rank's, on sizes every rank timed
        expected = "7 [(1, 10.0), (2, 15.0)]"
        assert [open(os.path.join(tmp, f"rank{r}")).read() for r in (0, 1)] == [expected, expected]


# --- CUDA ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_cuda_oom_is_caught_freed_and_the_probe_goes_on():
    from hf_accum.probing.meters import CudaMeter

    meter = CudaMeter()
    chunk = 4 << 30  # each sample "needs" 4 GiB

    def step(micro):
        buf = torch.empty(micro * chunk, dtype=torch.uint8, device="cuda")
        buf.fill_(1)

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    free = torch.cuda.mem_get_info()[0]
    # a budget beyond the device, so the search's jumps meet real out-of-memory errors
    result = probe_micro_batches(step, meter, 2 * meter.capacity_bytes(), 256)
    assert any(t.status == "out of memory" for t in result.trials)
    assert 1 <= result.max_micro_batch_size <= free // chunk
    assert torch.cuda.memory_allocated() == before  # nothing of the failed steps is left


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_probe_model_on_cuda_plans_exactly_and_leaves_no_trace():
    model = probe_llama().cuda()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.cuda.get_rng_state()
    torch.cuda.synchronize()
    budget = torch.cuda.memory_allocated() + 256 * MiB
    result, plan = probe_model(model, seq_len=SEQ, target_batch_size=64, budget_bytes=budget)
    assert plan.micro_batch_size * plan.gradient_accumulation_steps == 64
    assert all(t.reserved_bytes is not None for t in result.trials if t.fits)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert torch.equal(rng, torch.cuda.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def test_random_batches_carry_a_padding_mask_as_padded_training_batches_do():
    make_batch = random_token_batch(probe_llama(), 16)
    one, three = make_batch(1), make_batch(3)
    assert bool(one["attention_mask"].all())  # a single row is never padded
    assert int((three["attention_mask"] == 0).sum()) == 1 and int(three["labels"][-1, -1]) == -100
    assert int((three["labels"] != -100).sum()) == 3 * 16 - 1
