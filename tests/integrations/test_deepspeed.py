"""DeepSpeed ZeRO-2 / ZeRO-3 under AccumTrainer, on CPU with gloo ranks (`deepspeed=<dict>`, `use_cpu=True`): the
plan reaches the engine (its micro / accumulation / train batch are the plan's; "auto" filled from it; an explicit
field contradicting it refused), the engine steps once per window however hf_accum cuts it, final weights equal
DDP's on the same data and target, an out-of-memory error stops every rank, and a resumed run is exact.

The launches skip DeepSpeed's JIT-compiled shm op (inference-only; see `workers.deepspeed_worker.skip_shm_comm_op`), so no
C++ compile runs in CI."""

import importlib.util
import json
import time

import pytest
import torch

from hf_accum.integrations.engines.deepspeed_batch import batch_contradiction, plan_fields, zero_stage
from tests.integrations.test_ddp import _torchrun

# Multi-rank tests (torchrun) run on one pytest-xdist worker under `--dist loadgroup` (tox's oldest env): two
# two-rank runs at once on 2 cores were seen to hang.
pytestmark = pytest.mark.xdist_group("torchrun")

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed is not installed (pip install deepspeed, the deepspeed extra)")

AUTO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}
PLAN = "micro 2 × accumulation 2 × world 2 = 8"


# --- the batch fields, pure ----------------------------------------------------------------------------------
@pytest.mark.parametrize("config, wrong", [
    (AUTO, None),
    ({}, None),  # absent fields: filled
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 8}, None),
    ({**AUTO, "train_micro_batch_size_per_gpu": 8}, "train_micro_batch_size_per_gpu=8"),
    ({**AUTO, "gradient_accumulation_steps": 1}, "gradient_accumulation_steps=1"),
    ({**AUTO, "train_batch_size": 16}, "train_batch_size=16"),
])
def test_explicit_batch_fields_must_equal_the_plan(config, wrong):
    problem = batch_contradiction(config, 2, 2, 2, PLAN)
    if wrong is None:
        assert problem is None
    else:
        key, value = wrong.split("=")
        want = plan_fields(2, 2, 2)[key]
        assert problem == (f"deepspeed config {wrong} contradicts hf_accum's plan ({PLAN}), which needs {key}={want}. "
                           f'Set "{key}": "auto" in the DeepSpeed config (hf_accum fills it from the plan) or {want}.')


def test_per_rank_fields_are_checked_before_the_world_size_is_known():
    assert batch_contradiction({"train_batch_size": 99}, 2, 2, None, "p") is None
    assert "gradient_accumulation_steps=3" in batch_contradiction({"gradient_accumulation_steps": 3}, 2, 2, None, "p")
    assert zero_stage({"zero_optimization": {"stage": 3}}) == 3 and zero_stage({}) == 0


# --- the arguments: refused before any distributed setup or model -----------------------------------------------
def _args(**kw):
    from hf_accum import AccumTrainingArguments

    return AccumTrainingArguments(output_dir="unused", report_to=[], use_cpu=True, **kw)


@pytest.mark.parametrize("fields, message", [
    ({"train_micro_batch_size_per_gpu": 2}, "deepspeed config train_micro_batch_size_per_gpu=2 fixes what auto_tune "
     "chooses (the probe measures through the DeepSpeed engine and plans it). Set \"train_micro_batch_size_per_gpu\": "
     "\"auto\", or auto_tune=False."),
    ({"gradient_accumulation_steps": 1}, "deepspeed config gradient_accumulation_steps=1 fixes what auto_tune"),
    ({"train_batch_size": 16}, "deepspeed config train_batch_size=16 contradicts target_batch_size=8. Set "
     "\"train_batch_size\": \"auto\" (hf_accum fills it from the plan) or 8."),
])
def test_auto_tune_under_deepspeed_refuses_fields_it_chooses(fields, message):
    with pytest.raises(ValueError) as info:
        _args(deepspeed={"zero_optimization": {"stage": 3}, **AUTO, **fields}, target_batch_size=8)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_auto_tune_under_deepspeed_takes_auto_fields_and_the_targets_total():
    for fields in (AUTO, {}, {"train_batch_size": 8}):
        assert _args(deepspeed={"zero_optimization": {"stage": 3}, **fields}, target_batch_size=8).tunes


@pytest.mark.parametrize("extra, micro_batching, message", [
    ({"train_micro_batch_size_per_gpu": 4}, "samples",
     "train_micro_batch_size_per_gpu=4 contradicts hf_accum's plan (micro 2 × accumulation 2 per rank on DeepSpeed "
     "ZeRO-2), which needs train_micro_batch_size_per_gpu=2."),
    # "tokens" loads each rank's window whole: the engine's micro-batch is the window, accumulation 1
    ({"gradient_accumulation_steps": 2}, "tokens",
     "gradient_accumulation_steps=2 contradicts hf_accum's plan (micro 4 × accumulation 1 per rank on DeepSpeed "
     "ZeRO-2), which needs gradient_accumulation_steps=1."),
])
def test_an_explicit_field_contradicting_the_arguments_plan_is_refused(extra, micro_batching, message):
    with pytest.raises(ValueError) as info:
        _args(deepspeed={"zero_optimization": {"stage": 2}, **AUTO, **extra}, per_device_train_batch_size=2,
              gradient_accumulation_steps=2, target_batch_size=4, auto_tune=False, micro_batching=micro_batching,
              max_tokens_per_forward=64)
    assert str(info.value) == f"deepspeed config {message} " + str(info.value).split(". ", 1)[1]
    assert "\n" not in str(info.value)


@needs_deepspeed
def test_the_op_skip_the_launches_rely_on_means_no_compile():
    # the workers mark the inference-only shm op incompatible; DeepSpeed's comm backend then builds nothing
    import importlib

    import deepspeed.ops

    from tests.workers.deepspeed_worker import skip_shm_comm_op

    ops = deepspeed.ops.__compatible_ops__
    saved = dict(ops)
    try:
        skip_shm_comm_op()
        assert importlib.import_module("deepspeed.comm.torch").build_shm_op() is None
    finally:
        ops.update(saved)


# --- launches -----------------------------------------------------------------------------------------------
def _update_diff(got, want, start):
    num = sum(float(((got[n] - start[n]) - (want[n] - start[n])).pow(2).sum()) for n in start)
    den = sum(float((want[n] - start[n]).pow(2).sum()) for n in start)
    assert den > 0
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed")
    start = time.monotonic()
    proc = _torchrun("deepspeed_worker.py", "train", out, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    print(f"two-rank DeepSpeed launch: {time.monotonic() - start:.1f} s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


# How far a ZeRO run's update may be from float64 DDP's: ZeRO-2 trains the float64 model, and DeepSpeed's optimizer
# updates fp32 master weights (~3e-7 here, not 1e-16); ZeRO-3 trains it in float32 (DeepSpeed shards no float64
# parameters: the worker's docstring), whose forward and backward round at ~1e-5 (float32 DDP against float64 DDP:
# 1.45e-5 on one machine, ZeRO-3 1.11e-5).
UPDATE_TOLERANCE = {2: 1e-5, 3: 1e-4}


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("run, stage", [("zero2", 2), ("zero3", 3)])
def test_zero_ends_with_ddps_weights_and_runs_the_plan(zero_runs, run, stage):
    for res in zero_runs:
        diff = _update_diff(res[run], res["ddp"], res["initial"])
        print(f"{run}: relative difference of the update vs DDP {diff:.2e}")
        assert diff <= UPDATE_TOLERANCE[stage]
        engine = res[f"{run}_engine"]
        assert (engine["stage"], engine["micro"], engine["accumulation"], engine["train_batch"]) == (stage, 2, 2, 8)
        assert engine["engine_steps"] == engine["steps"] == 3
        assert res[f"{run}_forwards"] == res["ddp_forwards"] == 6


@pytest.mark.slow
@needs_deepspeed
def test_a_window_cut_into_forwards_steps_the_engine_once(zero_runs):
    # micro_batching="tokens": each rank's window (4 samples) is one loaded batch, cut by a 40-token budget into
    # several forwards; without the per-chunk boundary the engine stepped at every forward (11 steps, diff 2.1)
    for res in zero_runs:
        engine = res["zero2_tokens_engine"]
        assert engine["plan"] == {"micro_batch_size": 4, "gradient_accumulation_steps": 1, "world_size": 2,
                                  "target_batch_size": 8, "token_budget": 40, "engine": "DeepSpeed ZeRO-2"}
        assert (engine["micro"], engine["accumulation"], engine["train_batch"]) == (4, 1, 8)
        assert res["zero2_tokens_forwards"] > 6, "the windows were cut into more forwards than loaded batches"
        assert engine["engine_steps"] == engine["steps"] == 3
        assert engine["describe"].endswith("on DeepSpeed ZeRO-2")
        assert _update_diff(res["zero2_tokens"], res["ddp"], res["initial"]) <= 1e-5


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("run, stage", [("zero2_tuned", 2), ("zero3_tuned", 3)])
def test_auto_tune_probes_through_the_engine_and_changes_nothing(zero_runs, run, stage):
    # target 8 on 2 ranks, probe capped at micro 2: the plan is DDP's, so the final weights must be too
    plan = {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "world_size": 2, "target_batch_size": 8,
            "engine": f"DeepSpeed ZeRO-{stage}"}
    trials = [[(t["micro_batch_size"], t["peak_bytes"], t["status"]) for t in res[f"{run}_trials"]] for res in zero_runs]
    assert trials[0] == trials[1], "every rank ran the same trials and read the same (agreed) figures"
    assert [m for m, _, _ in trials[0]] == [1, 2]
    for res in zero_runs:
        after = res[f"{run}_after_probe"]  # when the first optimizer step begins, after the probe's steps
        # (ZeRO-3's float32 weights equal the float64 initial ones: the model is built in float32, then cast)
        assert all(torch.equal(after["weights"][n], res["initial"][n]) for n in res["initial"])
        assert after["engine_steps"] == 0 and not after["scratch_left"]
        engine = res[f"{run}_engine"]
        assert engine["plan"] == plan and res[f"{run}_stored"] == {k: v for k, v in plan.items() if k != "engine"}
        # each rank loads its whole window (4), the engine's batch fields say so, and hf_accum cuts it into the plan's
        # 2 forwards of 2, setting the engine's boundary per forward
        assert (engine["stage"], engine["micro"], engine["accumulation"], engine["train_batch"]) == (stage, 4, 1, 8)
        assert engine["config"] == [4, 1, 8]  # the config accelerate holds (and saves with the arguments)
        assert engine["engine_steps"] == engine["steps"] == 3
        assert res[f"{run}_args"] == [4, 1]  # after train(), the arguments hold the loaded window
        assert res[f"{run}_forwards"] == 6 + 3  # each window cut into 2 forwards; the probe's warm-up and 2 trials
        diff = _update_diff(res[run], res["ddp"], res["initial"])
        print(f"{run}: relative difference of the update vs DDP {diff:.2e}")
        assert diff <= UPDATE_TOLERANCE[stage]
        # the probe's step at the plan's micro-batch bounds a real optimizer step (CPU meter, above each baseline;
        # 1 MiB for the profiler's share of gloo and bookkeeping). Under ZeRO-2 the step allocates DeepSpeed's
        # gradient buckets (4 GB at its default bucket size), which a probe of the unwrapped model never sees.
        probe = next(t for t in res[f"{run}_trials"] if t["micro_batch_size"] == 2)
        real = res[f"{run}_real_peak"]
        print(f"{run}: probe step {probe['peak_bytes'] - probe['baseline_bytes']} B, real step "
              f"{real['peak_bytes'] - real['baseline_bytes']} B above their baselines")
        assert real["peak_bytes"] - real["baseline_bytes"] <= probe["peak_bytes"] - probe["baseline_bytes"] + 2**20
        if stage == 2:
            assert probe["peak_bytes"] - probe["baseline_bytes"] > 2**30
            reused = res["zero2_reused"]  # a second run in the same output_dir: the stored plan, no probe
            assert not reused["probed"] and reused["engine"]["plan"] == plan
            assert (reused["engine"]["micro"], reused["engine"]["accumulation"], reused["engine"]["steps"]) == (4, 1, 1)


@pytest.mark.slow
@needs_deepspeed
def test_auto_tune_measures_a_token_budget_through_the_engine(zero_runs):
    trials = [[(t["micro_batch_size"], t["peak_bytes"]) for t in res["zero2_tokens_tuned_trials"]] for res in zero_runs]
    assert trials[0] == trials[1] and trials[0]
    for res in zero_runs:
        engine = res["zero2_tokens_tuned_engine"]
        assert engine["plan"]["token_budget"] >= 40 and engine["plan"]["engine"] == "DeepSpeed ZeRO-2"
        assert (engine["micro"], engine["accumulation"], engine["train_batch"]) == (4, 1, 8)  # each rank's window
        assert engine["engine_steps"] == engine["steps"] == 3
        diff = _update_diff(res["zero2_tokens_tuned"], res["ddp"], res["initial"])
        print(f"zero2_tokens_tuned: token budget {engine['plan']['token_budget']}, {len(trials[0])} trials, "
              f"relative difference of the update vs DDP {diff:.2e}")
        assert diff <= 1e-5


def _launch_that_stops(mode, out):
    """A two-rank launch whose ranks must stop with an error, promptly (a hang would run into the timeout)."""
    start = time.monotonic()
    proc = _torchrun("deepspeed_worker.py", mode, out, timeout=300)
    took = time.monotonic() - start
    assert proc.returncode != 0 and took < 240, f"a clean stop, no hang ({took:.0f} s)"
    return proc


@pytest.mark.slow
@needs_deepspeed
def test_out_of_memory_in_the_engine_probe_stops_every_rank(tmp_path):
    proc = _launch_that_stops("probe_oom", tmp_path)
    for r in (0, 1):  # each rank records how it stopped; where one did not, its output says why
        record = tmp_path / f"probe_oom.rank{r}.json"
        assert record.exists(), (proc.stdout + proc.stderr)[-6000:]
        got = json.loads(record.read_text())
        assert got["raised"]["type"] == "StopTraining" and got["step"] == 0
        message = got["raised"]["message"]
        assert message.startswith("hf_accum: out of memory while the probe ran micro-batch 1 through DeepSpeed ZeRO-3")
        assert message.endswith("Every rank stops before the first optimizer step; no weights were changed.")
    assert "on another rank" in json.loads((tmp_path / "probe_oom.rank0.json").read_text())["raised"]["message"]


@pytest.mark.slow
@needs_deepspeed
def test_zero3_resume_is_exact_and_keeps_the_plan(zero_runs):
    for res in zero_runs:
        num = sum(float((res["resumed"][n] - res["resume_full"][n]).pow(2).sum()) for n in res["initial"])
        den = sum(float((res["resume_full"][n] - res["initial"][n]).pow(2).sum()) for n in res["initial"])
        assert (num / den) ** 0.5 <= 1e-10
        assert res["checkpoint_plan"] == {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "world_size": 2,
                                          "target_batch_size": 8, "engine": "DeepSpeed ZeRO-3"}
        engine = res["resumed_engine"]
        assert (engine["micro"], engine["accumulation"], engine["train_batch"], engine["steps"]) == (2, 2, 8, 4)
        assert engine["describe"] == "micro 2 × accumulation 2 × world 2 = 8 on DeepSpeed ZeRO-3"


@pytest.mark.slow
@needs_deepspeed
def test_oom_under_zero3_stops_every_rank_and_use_cpu_false_is_refused(tmp_path):
    proc = _launch_that_stops("oom", tmp_path)
    out = proc.stdout + proc.stderr
    assert "[rank1]: hf_accum.window.protocol.StopTraining: hf_accum: out of memory in a micro-batch" in out
    assert ("per_device_train_batch_size=1 and gradient_accumulation_steps=4 (micro 1 × accumulation 4 × world 2 = 8 "
            "on DeepSpeed ZeRO-3)") in out
    for r in (0, 1):  # written before the run that stops
        written = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "training sees world size 1: every rank would train on the same data" in written["world_one"]
        assert written["zero3_float64"] == (
            "deepspeed: ZeRO-3 cannot shard float64 parameters (DeepSpeed takes float32, bfloat16 or float16): cast the "
            "model first (model.float()), or use ZeRO stage 2.")
        assert written["left"] == []  # both refused when the trainer was built: no output_dir left behind
        got = json.loads((tmp_path / f"oom.rank{r}.json").read_text())
        assert got["raised"]["type"] == "StopTraining" and "gradient_accumulation_steps=4" in got["raised"]["message"]
    # rank 0 did not run out of memory: it stopped because rank 1 did (the reason passed through the store)
    assert "on another rank" in json.loads((tmp_path / "oom.rank0.json").read_text())["raised"]["message"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One one-process launch for the modes "single" and "defaults", in turn: the folder and the launch."""
    out = tmp_path_factory.mktemp("deepspeed_one")
    return out, _torchrun("deepspeed_worker.py", "single,defaults", out, nproc=1, timeout=500)


@pytest.mark.slow
@needs_deepspeed
def test_one_process_pieces_and_oom_stop(one_process):
    tmp_path, proc = one_process
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads((tmp_path / "single.json").read_text())
    assert res["shm_op"] is False  # nothing compiled
    # a plan applied before train() reaches the config accelerate builds the engine from
    assert res["filled"] == {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8,
                             "train_batch_size": 8}
    assert res["args_config_is_plugins"] and res["args"] == [1, 8]
    assert res["label"] == "DeepSpeed ZeRO-2" and res["describe"] == "micro 1 × accumulation 8 × world 1 = 8 on DeepSpeed ZeRO-2"
    # accelerate's backward steps the engine only in the chunk engine_boundary marks final
    assert res["engine_calls"] == ["boundary=False", "backward", "boundary=True", "backward", "step"]
    assert res["sync_after"] is True
    assert res["explicit"].startswith("deepspeed config train_micro_batch_size_per_gpu=2 contradicts hf_accum's plan "
                                      "(micro 1 × accumulation 8 × world 1 = 8 on DeepSpeed ZeRO-2)")
    # one process: DeepSpeed's partitions hold the window's gradients, so no re-run: a stop with the plan
    assert "out of memory under DeepSpeed" in res["oom"] and res["oom_steps"] == 1
    assert "per_device_train_batch_size=2 and gradient_accumulation_steps=4" in res["oom"]
    # tune() before train() has no engine to probe through
    assert res["tune_before_train"].startswith("tune() cannot probe a DeepSpeed run before train()")


@pytest.mark.slow
@needs_deepspeed
def test_deepspeed_with_default_arguments(one_process):
    """One process, ZeRO-2, no hf_accum argument set beyond the target: it trains; an explicit max_nonfinite_steps is
    refused; nothing fitting because of DeepSpeed's default buckets says so, naming their keys."""
    tmp_path, proc = one_process
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads((tmp_path / "defaults.json").read_text())
    assert res["steps"] == 2 and res["limit"] is None
    assert len(res["lines"]) == 1 and res["lines"][0].startswith("hf_accum: max_nonfinite_steps is off under DeepSpeed")
    assert res["explicit"].startswith("max_nonfinite_steps=3 is set, but DeepSpeed steps the optimizer inside backward")
    message = res["nothing_fits"]
    assert message.startswith("even micro-batch 1 does not fit: one training step through DeepSpeed ZeRO-2 needs ")
    assert "reduce_bucket_size=500000000, allgather_bucket_size=500000000 elements" in message
    assert "checkpointing or LoRA would not shrink them" in message
    assert '"reduce_bucket_size": 100000, "allgather_bucket_size": 100000' in message
    # the advice works: with those buckets the same 64 MiB budget fits the whole per-rank target
    assert res["advised_plan"] == "micro 4 × accumulation 1 × world 1 = 4 on DeepSpeed ZeRO-2"
    assert res["advised_peak"] < 64 * 2**20
