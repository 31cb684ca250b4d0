"""meters.py: the meters measure (a planted allocation shows up), repeat, and grow with the micro-batch."""

from __future__ import annotations

import pytest
import torch

from hf_accum.probing.meters import CpuMeter, CudaMeter, FakeMeter, _cgroup_limit_bytes, live_tensor_bytes
from hf_accum.window.oom import is_oom
from tests.exactness import probe_llama

MiB = 1 << 20
SEQ = 32

@pytest.fixture
def trained():
    """A tiny Llama, its AdamW with state already allocated, and a step function of the micro-batch."""
    model = probe_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(micro: int, plant: int = 0) -> None:
        planted = torch.ones(plant, dtype=torch.uint8) if plant else None  # held through the whole step
        ids = torch.randint(0, 256, (micro, SEQ), generator=torch.Generator().manual_seed(micro))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        del planted

    step(1)  # warm-up: creates the optimizer state
    return model, opt, step


# --- CPU ------------------------------------------------------------------------------------------------
def test_a_planted_allocation_is_the_peak_to_the_byte():
    def fn():
        buf = torch.empty(8 * MiB, dtype=torch.uint8)
        buf.fill_(1)
        del buf

    m = CpuMeter().measure(fn)
    assert m.peak_bytes == 8 * MiB
    assert m.baseline_bytes == 0 and m.reserved_bytes is None and m.seconds > 0


def test_resident_bytes_are_added_as_the_baseline():
    m = CpuMeter(resident=lambda: 12345).measure(lambda: torch.zeros(MiB, dtype=torch.uint8))
    assert (m.baseline_bytes, m.peak_bytes) == (12345, 12345 + MiB)


def test_a_planted_allocation_shows_up_in_a_training_step_peak(trained):
    model, opt, step = trained
    meter = CpuMeter(resident=lambda: live_tensor_bytes(model, opt))
    plain = meter.measure(lambda: step(2))
    planted = meter.measure(lambda: step(2, plant=8 * MiB))
    assert planted.peak_bytes - plain.peak_bytes == 8 * MiB


def test_the_peak_repeats_to_the_byte(trained):
    model, opt, step = trained
    meter = CpuMeter(resident=lambda: live_tensor_bytes(model, opt))
    first, second = meter.measure(lambda: step(3)), meter.measure(lambda: step(3))
    assert first.peak_bytes == second.peak_bytes
    assert first.baseline_bytes == second.baseline_bytes > 0


def test_the_peak_grows_with_the_micro_batch_and_nearly_linearly(trained):
    model, opt, step = trained
    meter = CpuMeter(resident=lambda: live_tensor_bytes(model, opt))
    peaks = {m: meter.measure(lambda m=m: step(m)).peak_bytes for m in (1, 2, 4, 8)}
    assert peaks[1] < peaks[2] < peaks[4] < peaks[8]
    per_sample_low, per_sample_high = (peaks[4] - peaks[2]) / 2, (peaks[8] - peaks[4]) / 4
    assert per_sample_high == pytest.approx(per_sample_low, rel=0.05)


def test_the_baseline_counts_weights_gradients_and_optimizer_state(trained):
    model, opt, _ = trained
    n_params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # fp32 weights + gradients (kept, zeroed) + AdamW exp_avg + exp_avg_sq (+ one scalar step per tensor)
    steps = sum(1 for _ in model.parameters()) * 4
    assert live_tensor_bytes(model, opt) == 4 * n_params * 4 + buffers + steps


def test_shared_storage_is_counted_once():
    base = torch.zeros(1000)
    assert live_tensor_bytes([base, base[:10], base.view(10, 100)]) == 4000


def test_cpu_capacity_is_positive_and_the_cgroup_limit_is_read(tmp_path):
    assert CpuMeter().capacity_bytes() > 0
    v2 = tmp_path / "memory.max"
    v2.write_text("1073741824\n")
    assert _cgroup_limit_bytes([str(v2)]) == 1 << 30
    v2.write_text("max\n")
    assert _cgroup_limit_bytes([str(v2)]) is None
    v1 = tmp_path / "limit_in_bytes"
    v1.write_text("9223372036854771712\n")  # v1's "unlimited"
    assert _cgroup_limit_bytes([str(tmp_path / "missing"), str(v1)]) is None


# --- fake -----------------------------------------------------------------------------------------------
def test_fake_meter_reports_the_formula_and_raises_oom_over_capacity():
    ran = []
    meter = FakeMeter(lambda m: 100 + 10 * m, capacity_bytes=150, seconds=lambda m: 0.5 * m)
    m = meter.measure(lambda: ran.append(1), micro_batch_size=5)
    assert (m.peak_bytes, m.seconds, ran) == (150, 2.5, [1])
    with pytest.raises(torch.OutOfMemoryError) as info:
        meter.measure(lambda: ran.append(2), micro_batch_size=6)
    assert is_oom(info.value)
    assert ran == [1]  # an OOM comes at the first allocation: the step did not run
    assert meter.calls == [5, 6]


def test_fake_meter_needs_the_micro_batch_size():
    with pytest.raises(TypeError, match="micro_batch_size"):
        FakeMeter(lambda m: m, 10).measure(lambda: None)


# --- CUDA -----------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cuda_meter_refuses_to_start_without_cuda():
    with pytest.raises(RuntimeError, match="CpuMeter"):
        CudaMeter()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_meter_sees_a_planted_allocation():
    meter = CudaMeter()
    keep = torch.zeros(MiB, device="cuda")  # 4 MiB live before the run: the baseline

    def fn():
        buf = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        buf.fill_(1)
        del buf

    m = meter.measure(fn)
    assert m.baseline_bytes >= 4 * MiB
    assert m.peak_bytes - m.baseline_bytes == 64 * MiB
    assert m.reserved_bytes >= m.peak_bytes
    assert meter.capacity_bytes() > m.reserved_bytes
    assert meter.unavailable_bytes() >= 0
    info = meter.describe()
    assert info["device"] and info["capacity_bytes"] == meter.capacity_bytes()
    del keep


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_grows_with_the_micro_batch():
    model = probe_llama().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(micro):
        ids = torch.randint(0, 256, (micro, SEQ), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    step(1)
    meter = CudaMeter()
    peaks = [meter.measure(lambda m=m: step(m)).peak_bytes for m in (1, 4, 16)]
    assert peaks[0] < peaks[1] < peaks[2]
