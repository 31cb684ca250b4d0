"""Two data-parallel ranks (torchrun, gloo, CPU): the step gradient and logged loss are those of one pass over
every sample of both ranks, with transformers' average_tokens_across_devices on or off."""

import os
import socket

import pytest
import torch

from tests.exactness import CASES, StepRecorder, max_step_error, reference_run
from tests.launch import launch

# Multi-rank tests (torchrun) run on one pytest-xdist worker under `--dist loadgroup` (tox's oldest env): two
# two-rank runs at once on 2 cores were seen to hang.
pytestmark = pytest.mark.xdist_group("torchrun")

RUNS = ["causal_lm:1", "causal_lm:0", "no_loss_kwargs_class:1", "explicit_args_wrapper:0"]
UNEVEN = "causal_lm:1:uneven"  # the tuner plans target 14 (7 per rank) where 3 fit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_ranks(out, runs, trainer="accum"):
    proc = launch("ddp_worker.py", "--out", out, "--trainer", trainer, *runs, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def check_run(out, run):
    name = run.split(":")[0]
    ranks = [torch.load(os.path.join(out, f"{run.replace(':', '_')}.rank{r}.pt"), weights_only=False) for r in (0, 1)]
    windows = [w0 + w1 for w0, w1 in zip(ranks[0]["windows"], ranks[1]["windows"])]
    recorder = StepRecorder()
    recorder.grads, recorder.weights = ranks[0]["grads"], ranks[0]["weights"]
    ref = reference_run(CASES[name].model(), recorder, windows, CASES[name].kind)
    return ranks, windows, max_step_error(recorder, ref), ref


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_two_ranks_match_one_pass(ddp_runs, run):
    ranks, windows, err, ref = check_run(ddp_runs, run)
    assert [len(w) for w in windows] == [4, 2], "each rank: 3 micro-batches of 8 samples, accumulation 2"
    assert err <= 1e-6, f"{run}: relative gradient error {err:.3e}"
    for g0, g1 in zip(ranks[0]["grads"], ranks[1]["grads"]):  # DDP synchronized both ranks
        for n in g0:
            torch.testing.assert_close(g0[n], g1[n], rtol=0, atol=0)
    assert ranks[0]["losses"] == pytest.approx(ref.losses, rel=1e-6)
    assert ranks[0]["avg_flag_after"] is False  # overridden (and logged) in favour of our exact counting


@pytest.mark.slow
def test_two_ranks_cut_an_uneven_window_exactly(ddp_runs):
    """Target 14 on 2 ranks where 3 samples fit: each rank's window of 7 is loaded whole and cut into 3 forwards
    (2 + 2 + 3, no divisor of 7 needed); one pass over both ranks' samples is the reference. (24 samples: accelerate's
    even_batches completes the last window from the start, as it does for any DDP run.)"""
    ranks, windows, err, ref = check_run(ddp_runs, UNEVEN)
    assert [len(w) for w in windows] == [2, 2], "one loaded window per rank per step"
    assert [sum(int(b["input_ids"].shape[0]) for b in w) for w in windows] == [14, 14]
    assert ranks[0]["plan"] == ranks[1]["plan"]  # one plan (and checkpointing level) on both ranks
    kernel = ranks[0]["plan"]["levers"]["loss_kernel"]  # timed on each rank, agreed (MAX over ranks): one choice
    assert kernel["kernel"] in ("torch", "chunked") and set(kernel["seconds"]) == {"torch", "chunked"}
    core = ("micro_batch_size", "gradient_accumulation_steps", "world_size", "target_batch_size")
    for r in ranks:
        assert {k: r["plan"][k] for k in core} == {
            "micro_batch_size": 3, "gradient_accumulation_steps": 3, "world_size": 2, "target_batch_size": 14}
        assert len(r["forwards"]) == 6 and sorted(r["forwards"][:3]) == sorted(r["forwards"][3:]) == [2, 2, 3]
    assert err <= 1e-6, f"relative gradient error {err:.3e}"
    assert ranks[0]["losses"] == pytest.approx(ref.losses, rel=1e-6)


@pytest.fixture(scope="module")
def tune_runs(tmp_path_factory):
    """One launch of `ddp_tune_worker.py`: the run with checkpointing off (folder "plain"), then the one whose probe
    also chooses the checkpointing level (folder "auto")."""
    out = tmp_path_factory.mktemp("ddp_tune")
    proc = _torchrun("ddp_tune_worker.py", out / "plain", out / "auto", "auto")
    return out, proc


@pytest.mark.slow
def test_ranks_with_different_budgets_agree_on_the_most_constrained_plan(tune_runs):
    out, proc = tune_runs
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    import json

    tmp_path = out / "plain"

    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r1["local_max"] < r0["local_max"], "rank 1 has the tighter budget"
    assert r0["agreed_max"] == r1["agreed_max"] == r1["local_max"]
    assert r0["plan"] == r1["plan"]
    plan = r0["plan"]
    assert plan["world_size"] == 2 and plan["micro_batch_size"] * plan["gradient_accumulation_steps"] * 2 == 16
    assert r0["steps"] == r1["steps"] == 2

    # Launched again: rank 0 finds the plan it saved, rank 1 (its own output_dir) none. Both probe again and agree;
    # before, rank 0 reused its plan and rank 1 waited forever in the probe's first collective.
    assert (tmp_path / "rank0" / "hf_accum_plan.json").exists() and not (tmp_path / "rank1" / "hf_accum_plan.json").exists()
    proc = _torchrun("ddp_tune_worker.py", tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "the stored plan is not reused: another rank found none. Probing again on every rank." in proc.stderr
    again = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert again[0]["plan"] == again[1]["plan"] and again[0]["steps"] == again[1]["steps"] == 2
    core = ("micro_batch_size", "gradient_accumulation_steps", "world_size")  # the loss kernel is timed anew
    assert {k: again[0]["plan"][k] for k in core} == {k: plan[k] for k in core}


@pytest.mark.slow
def test_ranks_with_different_budgets_agree_on_one_checkpointing_level(tune_runs):
    out, proc = tune_runs
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    import json

    tmp_path = out / "auto"

    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["levels"] is not None and r0["levels"] == r1["levels"]  # each rank's measurements, agreed
    (name, record), = [(k, v) for k, v in r0["plan"]["levers"].items() if k != "loss_kernel"]  # the lever the probe
    # searched (selective contains checkpointing); the loss kernel's record sits beside it
    assert r0["plan"] == r1["plan"] and record["of"] == 2
    recomputing = record["layers"] if name == "checkpointing" else record["full"] + record["selective"]
    assert r0["checkpointed_now"] == r1["checkpointed_now"] == recomputing
    assert r0["steps"] == r1["steps"] == 2


def _torchrun(script, *argv, timeout=600, nproc=2, freeze=True):
    """``torchrun --nproc_per_node NPROC tests/workers/SCRIPT ARGV...``, its ranks forked (`tests.launch`)."""
    return launch(script, *argv, nproc=nproc, timeout=timeout, env={"KINETO_LOG_LEVEL": "3"}, freeze=freeze)


@pytest.fixture(scope="module")
def oom_runs(tmp_path_factory):
    """One launch of `ddp_oom_worker.py` for the modes that train to the end, each in its own folder."""
    out = tmp_path_factory.mktemp("ddp_oom")
    return out, _torchrun("ddp_oom_worker.py", out, "forward:3", "forward:4", "growback")


@pytest.mark.slow
@pytest.mark.parametrize("call", [3, 4], ids=["mid-window", "final-forward"])
def test_one_ranks_oom_switches_both_ranks_and_matches_a_clean_run(oom_runs, call):
    out, proc = oom_runs
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    import json

    tmp_path = out / f"forward{call}"

    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["plan"] == r1["plan"] == {"micro_batch_size": 2, "gradient_accumulation_steps": 4, "world_size": 2,
                                        "target_batch_size": 16}
    assert r0["steps"] == r1["steps"] == [3, 3]
    for r in (0, 1):
        w = torch.load(tmp_path / f"weights.rank{r}.pt")
        num = sum(float((w["hit"][k] - w["clean"][k]).pow(2).sum()) for k in w["hit"])
        den = sum(float(v.pow(2).sum()) for v in w["clean"].values())
        assert (num / den) ** 0.5 <= 1e-10
    said = "\n".join(r0["said"] + r1["said"])  # what the hf_accum loggers said during this mode's run
    assert said.count("out of memory at step 1") == 2  # logged by both ranks
    assert (proc.stderr + proc.stdout).count("out of memory at step 1") == 4  # and printed: 2 ranks x 2 modes


@pytest.mark.slow
def test_after_one_ranks_oom_both_ranks_grow_back_at_the_same_step(oom_runs):
    out, proc = oom_runs
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    import json

    tmp_path = out / "growback"
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    said = "\n".join(r0.pop("said") + r1.pop("said"))  # what the hf_accum loggers said during this mode's run
    assert r0 == r1 == {"plan": {"micro_batch_size": 4, "gradient_accumulation_steps": 2, "world_size": 2,
                                 "target_batch_size": 16}, "cut": None}
    for r in (0, 1):
        w = torch.load(tmp_path / f"weights.rank{r}.pt")
        num = sum(float((w["hit"][k] - w["clean"][k]).pow(2).sum()) for k in w["hit"])
        den = sum(float(v.pow(2).sum()) for v in w["clean"].values())
        assert (num / den) ** 0.5 <= 1e-10
    assert said.count("1 clean steps since the out-of-memory error at step 0; back to") == 2
    assert (proc.stderr + proc.stdout).count("1 clean steps since the out-of-memory error at step 0; back to") == 2


@pytest.mark.slow
def test_oom_in_the_synchronized_backward_stops_all_ranks_cleanly(tmp_path):
    import time

    start = time.monotonic()
    proc = _torchrun("ddp_oom_worker.py", tmp_path, "backward", timeout=300)
    assert proc.returncode != 0
    assert time.monotonic() - start < 240, "no hang"
    out = proc.stdout + proc.stderr
    assert "inside the gradient-synchronizing backward" in out
    assert "per_device_train_batch_size=2 and gradient_accumulation_steps=4" in out


@pytest.mark.slow
def test_oom_where_forwards_run_collectives_stops_every_rank_with_the_plan(tmp_path):
    out = _stopped_within(240, "ddp_oom_worker.py", tmp_path, "stop")
    assert "engine with collectives in every forward" in out and "every rank stops" in out
    assert "per_device_train_batch_size=2 and gradient_accumulation_steps=4" in out


def _stopped_within(seconds, script, *argv):
    """Runs two ranks that must fail, not hang; returns their output."""
    import time

    start = time.monotonic()
    proc = _torchrun(script, *argv, timeout=300)
    assert proc.returncode != 0 and time.monotonic() - start < seconds, "a clean stop, no hang"
    return proc.stdout + proc.stderr
