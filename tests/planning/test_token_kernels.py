"""The token measurement run once per loss kernel and the kernel chosen by whole steps (planning/token_kernels.py),
with the probe and `token_plan` stood in by what each kernel "measured": which probe each kernel's lengths are
measured with, what the chosen plan keeps, and a kernel that fits nothing. No model runs here."""

import contextlib
from types import SimpleNamespace

import pytest

from hf_accum.planning import token_kernels
from hf_accum.probing.loop import NothingFitsError, ProbeResult
from hf_accum.probing.plan import Plan

LONGEST = 100
# kernel -> (tokens per forward, a forward's fixed seconds, seconds per token); None: even one row does not fit
MEASURED = {"fast": (200, 1.0, 1e-3), "lean": (400, 1.0, 1.5e-3), "huge": None}


def result(extra=None):
    return ProbeResult(trials=[], max_micro_batch_size=1, fitted=None, budget_bytes=1, capacity_bytes=1,
                       max_micro_batch=16, extra=dict(extra or {}))


@pytest.fixture
def stand_ins(monkeypatch):
    """The kernel in force, and each call of the probe and of `token_plan` as (kernel, length, seed)."""
    state = SimpleNamespace(kernel=None, probes=[], plans=[], leveled=False)

    @contextlib.contextmanager
    def pinned(model, kernel):
        state.kernel = kernel
        yield
        state.kernel = None

    def token_plan(trainer, plan, res, seq_len, probe, lengths):
        tokens, fixed, per_token = MEASURED[state.kernel]
        probe(None, seq_len // 2)  # the short length, through the probe token_plan is given
        state.plans.append(state.kernel)
        step_time = {"forward_seconds": fixed, "token_seconds": {str(LONGEST): per_token}}
        res.extra["token_budget"] = {"tokens_per_forward": tokens}
        return Plan(4, 1, 1, 4, token_budget=tokens, step_time=step_time), res

    def probe(make_batch, length, seed=None, **kwargs):
        state.probes.append((state.kernel, length, seed))
        if MEASURED[state.kernel] is None:
            raise NothingFitsError("micro-batch 1 does not fit", result())
        first, state.leveled = not state.leveled, True  # the level search runs in the first probe that fits
        extra = {"checkpointing": {"chosen_k": 1}} if first else {}
        levers = {"checkpointing": {"layers": 1, "of": 2}} if first else None
        return result(extra), Plan(4, 1, 1, 4, levers=levers, step_seconds=0.5 if first else None)

    monkeypatch.setattr(token_kernels, "pinned", pinned)
    monkeypatch.setattr(token_kernels, "token_plan", token_plan)
    state.probe = probe
    return state


def measure(state, kernels):
    trainer = SimpleNamespace(model=None, args=SimpleNamespace(target_batch_size=4, world_size=1),
                              _collective=lambda: SimpleNamespace(world=1))
    prepared = SimpleNamespace(make_batch=None, seq_len=LONGEST, lengths=[LONGEST] * 4)
    return token_kernels.measure_tokens(trainer, state.probe, prepared, kernels)


@pytest.mark.parametrize("kernels, chosen, refused", [
    (["fast", "lean"], "lean", None),   # 2 forwards x 1.0 s + 0.4 against 1 forward + 0.6: whole steps decide
    (["lean", "fast"], "lean", None),
    (["huge", "fast"], "fast", ["huge"]),  # a kernel that fits nothing drops out; the others are measured
])
def test_each_kernel_measures_its_budget_and_the_least_whole_step_is_planned(stand_ins, kernels, chosen, refused):
    plan, res = measure(stand_ins, kernels)
    record = plan.levers["loss_kernel"]
    assert record["kernel"] == chosen and record.get("nothing_fits") == refused
    assert plan.token_budget == MEASURED[chosen][0] and plan.step_time["forward_seconds"] == MEASURED[chosen][1]
    assert res.extra["loss_kernel"] == record and set(res.extra["token_kernels"]) == set(record["tokens_per_forward"])
    # every kernel measured its lengths pinned; the first fitting kernel from the usual start (no seed), the others
    # seeded at each length by the rows the first kernel's budget holds there
    fitting = [k for k in kernels if MEASURED[k] is not None]
    assert stand_ins.plans == fitting
    first = MEASURED[fitting[0]][0]
    for kernel, length, seed in stand_ins.probes:
        assert seed == (None if kernel in (kernels[0], fitting[0]) else first // length)
    # the level the first probe chose stays in the plan whichever kernel wins
    assert plan.levers["checkpointing"] == {"layers": 1, "of": 2} and res.extra["checkpointing"] == {"chosen_k": 1}
    assert plan.step_seconds == 0.5


def test_one_kernel_or_none_is_measured_once_as_before(stand_ins):
    stand_ins.kernel = "fast"  # as the probe runs it (a pin, or the one kernel that runs here)
    plan, res = measure(stand_ins, ["fast"])
    assert "loss_kernel" not in (plan.levers or {}) and "token_kernels" not in res.extra
    assert [seed for _, _, seed in stand_ins.probes] == [None, None] and plan.token_budget == 200


def test_no_kernel_fitting_raises_the_first_kernels_error(stand_ins):
    MEASURED["also_huge"] = None
    try:
        with pytest.raises(NothingFitsError):
            measure(stand_ins, ["huge", "also_huge"])
    finally:
        del MEASURED["also_huge"]
