"""The plain-loop API (`hf_accum.loop`): exact window normalization in a user's own loop, against an independent
reference (one pass over the window's samples on every rank, cross-entropy by hand, float64), in one process
with an OOM re-run, with two gloo ranks under DDP, and under FSDP2 (`fully_shard`), where an OOM stops every rank."""

import os
import time

import pytest
import torch

from hf_accum.loop import Accumulator, windows

from .exactness import lm_examples, pad_collate, reference_step, relative_error, tiny_gpt2
from .test_ddp import _torchrun
from .test_oom_recovery import OOMAt


def test_windows_groups_micro_batches():
    assert [len(w) for w in windows(range(7), 3)] == [3, 3, 1]
    with pytest.raises(ValueError, match="accumulation_steps=0 must be a positive integer"):
        next(windows(range(3), 0))


@pytest.mark.parametrize("oom", [False, True], ids=["clean", "oom-mid-window"])
def test_one_process_loop_is_one_pass_over_the_window(oom):
    model = tiny_gpt2()
    if oom:
        OOMAt(model.transformer.h[1], [2])  # the window's second forward runs out of memory
    data = lm_examples(16, seed=4)
    loader = [pad_collate(data[i:i + 4]) for i in range(0, 16, 4)]
    acc = Accumulator(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = tiny_gpt2()
    for window in windows(loader, 2):
        reference.load_state_dict(model.state_dict())
        loss = acc.backward(window, lambda m, b: m(**b).loss)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        want, want_loss = reference_step(reference, window, "causal")
        # transformers' causal-LM loss casts logits to float32: ~1e-8
        assert relative_error(grads, want) <= 1e-6
        assert float(loss) == pytest.approx(want_loss, rel=1e-6)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert acc.cut_units == (2 if oom else None)  # after the OOM: half of the 4 rows per forward


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("loop")
    start = time.monotonic()
    proc = _torchrun("loop_worker.py", out, timeout=300)
    return out, proc, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_two_ranks_loop_is_one_pass_over_both_ranks_windows(two_rank_runs, kind):
    out, proc, _ = two_rank_runs
    r0, r1 = (torch.load(os.path.join(out, f"{kind}.rank{r}.pt"), weights_only=False) for r in (0, 1))
    reference = tiny_gpt2()
    assert len(r0["grads"]) == 2
    for step, (weights, w0, w1) in enumerate(zip(r0["weights"], r0["windows"], r1["windows"])):
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p.copy_(weights[n])
        want, want_loss = reference_step(reference, w0 + w1, "causal")
        for rank in (r0, r1):
            assert relative_error(rank["grads"][step], want) <= 1e-6, kind
        assert (r0["losses"][step] + r1["losses"][step]) / 2 == pytest.approx(want_loss, rel=1e-6)


@pytest.mark.slow
def test_fsdp2_oom_stops_every_rank_without_hanging(two_rank_runs):
    out, proc, seconds = two_rank_runs
    assert os.path.exists(os.path.join(out, "fsdp2.rank1.pt")), proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.returncode != 0 and seconds < 240
    assert "engine with collectives in every forward" in proc.stdout + proc.stderr
