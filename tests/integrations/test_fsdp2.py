"""FSDP2 applied at load time (transformers' DistributedConfig) with two gloo ranks on CPU: AccumTrainer ends with
the weights DDP ends with on the same data and target (accumulation 2); the meter and the probe count each rank's
local shards; the window protocol treats it as a sharded engine, and an OOM on one rank stops every rank with the
plan to restart with; resuming (which transformers cannot do exactly for such a model) is refused before any work."""

import json
import time

import pytest
import torch
import transformers
from packaging import version

from tests.exactness import tiny_llama
from tests.integrations.test_ddp import _torchrun

# Multi-rank tests (torchrun) run on one pytest-xdist worker under `--dist loadgroup` (tox's oldest env): two
# two-rank runs at once on 2 cores were seen to hang.
pytestmark = pytest.mark.xdist_group("torchrun")

needs_load_time_fsdp2 = pytest.mark.skipif(
    version.parse(transformers.__version__) < version.parse("5.18"),
    reason="load-time FSDP2 (DistributedConfig fsdp_size) needs transformers newer than 5.17")


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    src = tmp_path_factory.mktemp("fsdp2") / "model"
    initial = tiny_llama(torch.float64)
    initial.save_pretrained(src)
    return src, {n: p.detach() for n, p in initial.named_parameters()}


@pytest.fixture(scope="module")
def launch(tmp_path_factory, saved_model):
    """One launch for the runs that end cleanly: the fallback refusals (folder "fallback"), then, where transformers
    can shard at load time, the FSDP2 training run and the seeded probes; the folder and the launch."""
    out = tmp_path_factory.mktemp("fsdp2_runs")
    if version.parse(transformers.__version__) < version.parse("5.18"):  # no load-time FSDP2: the refusals alone
        return out, _torchrun("fallback_worker.py", out / "fallback", timeout=300)
    return out, _torchrun("fsdp2_worker.py", "fallback,train,seed", saved_model[0], out, timeout=400)


@pytest.mark.slow
@needs_load_time_fsdp2
def test_load_time_fsdp2_matches_ddp_and_the_meter_and_probe_count_local_shards(launch, saved_model):
    src, start = saved_model
    tmp_path, proc = launch
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for res in ranks:
        assert res["sharded"] and res["fsdp2_policy"] == "stop" and res["ddp_policy"] == "rerun"
        # the meter reads each rank's local shards (a DTensor's storage pointer is not readable) and counts the
        # memory they keep alive: on CPU, transformers' load-time sharding leaves each shard a view of a storage
        # of the parameter's full size, so that is what the plan must budget for
        assert res["meter_bytes"] == res["local_storage_bytes"] >= res["local_shard_bytes"]
        assert res["local_shard_bytes"] < sum(p.numel() * 8 for p in start.values())
        # the probe's figure: every measured step starts from this rank's weights, zeroed gradient shards and
        # AdamW state shards, counted here after one real step by the storages behind the local shards
        assert res["probe_local_baselines"] and set(res["probe_local_baselines"]) == {res["counted_step_bytes"]}
        assert res["counted_step_bytes"] < res["unsharded_step_bytes"]
        ddp, fsdp = res["ddp"], res["fsdp2"]
        num = sum(float(((fsdp[n] - start[n]) - (ddp[n] - start[n])).pow(2).sum()) for n in start)
        den = sum(float((ddp[n] - start[n]).pow(2).sum()) for n in start)
        assert den > 0 and (num / den) ** 0.5 <= 1e-5
        # transformers checkpoints no optimizer state for a model sharded at load time: resuming is refused
        # before any work, naming the argument and the ways on, and a stop's advice is not "resume"
        assert res["resume_refusal"].startswith("resume_from_checkpoint=True cannot resume exactly")
        assert "from_pretrained(CHECKPOINT, distributed_config=...)" in res["resume_refusal"]
        assert res["untouched_by_refusal"]
        assert "cannot be resumed" in res["stop_advice"] and "resume_from_checkpoint" not in res["stop_advice"]
    assert ranks[0]["plan"] == ranks[1]["plan"]
    assert ranks[0]["probe_local_baselines"] != ranks[1]["probe_local_baselines"], "each rank measured its own shards"
    # every probe step all-gathers, so every rank ran the same trials on the largest figures over the ranks
    # (probing/agreed.py): the search read the larger rank's baseline on both
    largest = max(res["counted_step_bytes"] for res in ranks)
    for res in ranks:
        assert set(res["probe_baselines"]) == {largest}
        assert len(res["probe_baselines"]) == len(ranks[0]["probe_baselines"])
    # what a stop writes: the weights (gathered) and the state, never an optimizer file that could not be loaded
    files = ranks[0]["checkpoint_files"]
    assert "model.safetensors" in files and "trainer_state.json" in files and "optimizer.pt" not in files


@pytest.mark.slow
@needs_load_time_fsdp2
def test_load_time_fsdp2_oom_on_one_rank_stops_every_rank_with_the_plan(tmp_path, saved_model):
    src, _ = saved_model
    start = time.monotonic()
    proc = _torchrun("fsdp2_worker.py", "oom", src, tmp_path, timeout=300)
    seconds = time.monotonic() - start
    assert proc.returncode != 0 and seconds < 240, "a clean stop, no hang"
    plan = "per_device_train_batch_size=1 and gradient_accumulation_steps=4 (micro 1 × accumulation 4 × world 2 = 8)"
    for r in (0, 1):
        got = json.loads((tmp_path / f"oom.rank{r}.json").read_text())
        assert got["raised"]["type"] == "StopTraining" and got["step"] == 1, got
        assert "out of memory in a micro-batch" in got["raised"]["message"]
        assert plan in got["raised"]["message"] and "cannot be resumed" in got["raised"]["message"]
    # rank 0 did not run out of memory: it stopped because rank 1 did, and says so
    assert "on another rank" in json.loads((tmp_path / "oom.rank0.json").read_text())["raised"]["message"]


@pytest.mark.slow
def test_an_fsdp_request_that_would_fall_back_is_refused_on_every_rank(launch):
    out, proc = launch
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    tmp_path = out / "fallback"
    for r in (0, 1):
        messages = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "fsdp=" in messages["fsdp_on_cpu"] and "accelerate runs MULTI_CPU" in messages["fsdp_on_cpu"]
        assert "training sees world size 1: every rank would train on the same data" in messages["world_one"]


@pytest.mark.slow
@needs_load_time_fsdp2
def test_the_probe_under_fsdp2_starts_from_the_sharded_estimate_and_takes_two_trials_a_budget(launch):
    """Issue 55 item 3: at four budgets spread evenly over the sizes that fit, the probe seeded by the sharded
    estimate plans what the unseeded probe plans, and measures at most 2 sizes per budget on average (the fit and
    the size above it), where the unseeded search climbs from micro-batch 1."""
    out, proc = launch
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((out / f"seed.rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["runs"].keys() == ranks[1]["runs"].keys() and len(ranks[0]["runs"]) == 4
    seeded_trials, unseeded_trials = [], []
    for budget in ranks[0]["runs"]:
        runs = [res["runs"][budget] for res in ranks]
        assert runs[0]["seeded"]["plan"] == runs[1]["seeded"]["plan"] == runs[0]["unseeded"]["plan"], budget
        for run in runs:
            estimate = run["seeded"]["estimate"]
            assert estimate["sharded"] == "FSDP2 over 2 ranks" and estimate["largest_fit"] >= 1
            assert run["unseeded"]["estimate"] is None  # probe_from_estimate=False
            seeded_trials.append(len(run["seeded"]["sizes"]))
            unseeded_trials.append(len(run["unseeded"]["sizes"]))
    assert "hf_accum probe: estimate (cpu, fake tensors, FSDP2 over 2 ranks, " in proc.stdout + proc.stderr
    print(f"measured sizes per budget: seeded {seeded_trials}, unseeded {unseeded_trials}")
    assert sum(seeded_trials) / len(seeded_trials) <= 2
    assert sum(seeded_trials) < sum(unseeded_trials)
