"""A token budget's timed steps (probing/step_timing.py) and the probe's step cut into forwards
(`probe.make_step_fn`'s ``forwards``): which steps are run and what is kept, with a stand-in meter whose times
are given (no step is timed here)."""

from types import SimpleNamespace

import pytest
import torch

from hf_accum.probing import step_timing
from hf_accum.probing.loop import ProbeResult
from hf_accum.probing.probe import make_step_fn


def result(top):
    return ProbeResult(trials=[], max_micro_batch_size=top, fitted=None, budget_bytes=1, capacity_bytes=1,
                       max_micro_batch=64, extra={})


class GivenTimes:
    """A meter whose ``time(step)`` runs the step and answers the next of the seconds given for it."""

    name = "given"

    def __init__(self, seconds):
        self.seconds, self.calls = seconds, []

    def time(self, step, micro_batch_size):
        step()
        return self.seconds[self.calls[-1]].pop(0)


def timed(top, seconds):
    meter = GivenTimes(seconds)

    def step_fn(rows, forwards=1):
        meter.calls.append((rows, forwards))

    return step_timing.time_rows(result(top), step_fn, meter, None, torch.nn.Linear(1, 1)), meter.calls


def test_one_forward_is_timed_at_every_size_from_the_largest_fit_halving_and_the_optimizer_alone_fastest_kept():
    assert step_timing.sizes(7) == [1, 3, 7] and step_timing.sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    seconds = {(1, 1): [0.2, 0.1, 0.15], (3, 1): [0.5, 0.3, 0.4], (7, 1): [0.9, 0.8, 0.85], (0, 1): [0.05, 0.04, 0.06]}
    (one, optimizer), calls = timed(7, seconds)
    assert (one, optimizer) == ({"1": 0.1, "3": 0.3, "7": 0.8}, 0.04)  # JSON keys, as result.extra stores them
    # in turn: a drift moves all alike
    assert calls == [(1, 1), (3, 1), (7, 1), (0, 1)] * step_timing.REPEATS


def test_one_row_is_timed_at_one_size_and_paper_times_nothing():
    (one, optimizer), calls = timed(1, {(1, 1): [0.2, 0.2, 0.2], (0, 1): [0.1, 0.1, 0.1]})
    assert (one, optimizer) == ({"1": 0.2}, 0.1) and set(calls) == {(1, 1), (0, 1)}
    estimate = SimpleNamespace(name="estimate")
    assert step_timing.time_rows(result(8), lambda rows, forwards=1: None, estimate, None, None) == ({}, None)


class CountingSGD(torch.optim.SGD):
    steps = 0

    def step(self, closure=None):
        CountingSGD.steps += 1
        return super().step(closure)


@pytest.mark.parametrize("rows, forwards, batches", [(5, 1, [5]), (5, 2, [3, 2]), (8, 2, [4, 4])])
def test_a_step_cut_into_forwards_accumulates_them_into_one_optimizer_step(rows, forwards, batches):
    model = torch.nn.Linear(4, 1)
    CountingSGD.steps = 0
    opt = CountingSGD(model.parameters(), lr=0.1)
    made = []

    def make_batch(micro):
        made.append(micro)
        return {"x": torch.ones(micro, 4)}

    step = make_step_fn(model, opt, make_batch, forward=lambda m, batch: m(batch["x"]).sum())
    before = model.weight.detach().clone()
    step(rows, forwards=forwards)
    assert made == batches and CountingSGD.steps == 1
    # every row's gradient in the one step (the sum's: d/dw of Σ w·x over the rows is the row count)
    assert torch.allclose(before - model.weight.detach(), torch.full((1, 4), 0.1 * rows))
    assert model.weight.grad is not None and not model.weight.grad.any()  # zeroed, not freed
    made.clear()
    step(0)  # the optimizer's step alone: no batch, no forward, one optimizer step on the zeroed gradients
    assert made == [] and CountingSGD.steps == 2
