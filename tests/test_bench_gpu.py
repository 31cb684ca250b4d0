"""benchmarks/bench_gpu.py, the one command a GPU session runs, cannot rot before a GPU arrives: its --quick mode
runs every section on CPU here and must write every section's figures; --sections and --minutes behave. Also the
pure helpers it uses from hf_accum.probing.flops (bf16 peaks by device name, model FLOPs per token, MFU)."""

import contextlib
import importlib.util
import io
import json
import math
import os
import sys
import time
import types

import pytest
import torch

from hf_accum.probing import flops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_gpu.py")
SECTIONS = ["1_model", "2_probe", "3_train", "4_oom", "5_throughput", "6_tokens", "7_estimate", "8_levers",
            "9_loss_kernels"]


def load_script():
    """benchmarks/bench_gpu.py run as a script is (its sys.path: this checkout and benchmarks/), and the names its
    sections' package (benchmarks/gpu_bench/) defines, in one namespace."""
    if "bench_gpu" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_gpu"] = module
        spec.loader.exec_module(module)
    names = {}
    for part in ("context", "data", "s2_probe", "s4_oom", "s8_levers", "run"):
        names.update(vars(importlib.import_module(f"gpu_bench.{part}")))
    return types.SimpleNamespace(**names)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """The whole --quick run, once, in this process (the imports are paid once for every test here)."""
    out = tmp_path_factory.mktemp("quick")
    printed = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stdout(printed):
        assert load_script().main(["--quick", "--out", str(out)]) == 0
    with open(out / "bench_gpu.json") as f:
        return json.load(f), out, printed.getvalue(), time.monotonic() - start


# The tests that read `quick_run` go to one pytest-xdist worker (--dist loadgroup): it runs once, not once per worker.
@pytest.mark.xdist_group("bench_quick_run")
def test_quick_run_writes_every_section_with_its_figures(quick_run):
    data, out, stdout, _ = quick_run
    assert list(data["sections"]) == SECTIONS
    for key, section in data["sections"].items():
        assert section["status"] == "ok", (key, section.get("reason"), section.get("traceback"))
        assert section["figures"] and section["goals"], key
        assert "CUDA-only figures" in section["figures"]["null_reason"]
        for g in section["goals"]:
            assert set(g) >= {"name", "value", "goal", "pass"} and g["pass"] in (True, False, None)
    env = data["environment"]
    assert env["versions"]["torch"] and env["versions"]["transformers"] and env["quick"] is True
    assert env["command"].endswith("bench_gpu.py --quick --out " + str(out))
    assert data["goals"] and all("section" in g for g in data["goals"])

    s = {k: v["figures"] for k, v in data["sections"].items()}
    assert s["1_model"]["parameters"] > 0 and math.isfinite(s["1_model"]["first_step_loss"])

    rows = s["2_probe"]["rows"]
    assert len(rows) >= 4 and {r["config"] for r in rows} >= {"full", "full+ckpt", "lora", "lora+ckpt"}
    assert len({r["budget"] for r in rows}) == 2 and len({r["seq_len"] for r in rows}) == 2
    for r in rows:
        assert 1 <= r["chosen_micro"] <= r["reported_max"] <= r["largest_really_fitting"] <= r["target"]
        assert r["chosen_fits"] is True and r["probe_trials"] >= 1 and r["probe_seconds"] > 0
        # the probe again, started from the estimate: its trials counted, its maximum measured (the same search)
        assert r["seeded_trials"] >= 1 and r["seeded_max"] == r["reported_max"], r
        assert r["estimate_line"].startswith("estimate"), r
        sizes = [p["micro"] for p in r["sweep"]]
        assert 1 in sizes and r["chosen_micro"] in sizes
        # CUDA-only figures are null on CPU, with the reason
        assert r["chosen_reserved_bytes"] is None and r["chosen_nvml_used_bytes"] is None
        assert all(p.get("nvml_null_reason") for p in r["sweep"] if "charged_bytes" in p)
    assert "qlora" in s["2_probe"]["skipped"]  # QLoRA is skipped on CPU with a line saying so

    for r in s["3_train"]["rows"]:
        assert r["steps"] == 3 and r["oom_warnings"] == 0 and r["peak_bytes"] <= r["budget_bytes"]

    oom = s["4_oom"]
    assert len(oom["oom_warnings"]) == 1 and oom["steps"] == oom["max_steps"]
    assert oom["samples_loaded"] == oom["distinct_samples"] == oom["expected_samples"]
    assert oom["plan_after"]["effective_batch"] == oom["plan_before"]["effective_batch"]
    assert oom["plan_after"]["rows_per_forward_effective"] < oom["plan_before"]["rows_per_forward_effective"]

    tp = s["5_throughput"]
    assert tp["plan_tokens_per_second"] > 0 and tp["tokens_per_second_by_micro"]["1"] > 0
    assert tp["mfu_plan"] is None and tp["mfu_null_reason"]
    assert len(tp["overhead"]["ratios"]) == 2 and tp["overhead"]["median_ratio"] > 0

    tok = s["6_tokens"]
    assert set(tok["modes"]) == {"samples", "tokens"}
    assert tok["modes"]["tokens"]["padded_over_real_tokens"] <= tok["modes"]["samples"]["padded_over_real_tokens"]
    assert tok["fused_loss"]["on"]["peak_bytes"] > 0 and tok["fused_loss"]["off"]["peak_bytes"] > 0

    est = s["7_estimate"]
    assert est["device_estimated"] == "cpu"
    assert {(r["method"], r["seq"], r["micro"]) for r in est["rows"]} == {
        (m, seq, micro) for m in ("lora", "full") for seq in (64, 32) for micro in (1, 2)}
    assert all(abs(r["error_vs_peak"]) <= 0.05 and r["estimate_bytes"] > 0 for r in est["rows"])

    lev = s["8_levers"]
    assert "CUDA only" in lev["skipped"]["offload"] and "offload" not in {r["level"] for r in lev["rows"]}
    assert {(r["level"], r["layers"], r["micro"]) for r in lev["rows"]} == {
        (kind, k, m) for kind, k in (("none", 0), ("full", 1), ("full", 2), ("selective", 1), ("selective", 2))
        for m in (1, 2)}
    assert all(r["result"] == "ok" and r["step_seconds"] > 0 and r["peak_allocated_bytes"] > 0 for r in lev["rows"])
    by = {(r["level"], r["layers"], r["micro"]): r["peak_allocated_bytes"] for r in lev["rows"]}
    assert by[("full", 2, 2)] < by[("none", 0, 2)]  # the levers really were on
    tuner = lev["tuner"]
    record = tuner["plan"]["levers"]["selective"]  # the searched lever (its levels contain checkpointing's)
    assert record["full"] + record["selective"] >= 1  # the budget leaves no room for no checkpointing
    assert tuner["measured"]["result"] == "ok" and tuner["measured"]["charged_bytes"] <= tuner["budget_bytes"]
    assert "| level (section 8, seq 32) | micro 1 | micro 2 |" in stdout

    png = out / "bench_gpu.png"
    assert data["png"] and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| section | status |" in stdout  # the table


def test_sections_runs_only_those(tmp_path):
    bench = load_script()
    assert bench.main(["--quick", "--sections", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert list(data["sections"]) == ["1_model"]
    assert all(s["status"] == "ok" for s in data["sections"].values())
    assert data["png"] is None and "section 2 not selected" in data["png_null_reason"]
    with pytest.raises(SystemExit, match="sections are 1-9"):
        bench.main(["--quick", "--sections", "10", "--out", str(tmp_path)])


@pytest.mark.xdist_group("bench_quick_run")
def test_the_loss_kernel_section_measures_each_kernel_here(quick_run):
    # Read from the whole --quick run: section 9 is the same function on the same settings with or without the other
    # sections (its shape comes from --quick alone), so a run of `--sections 9` of its own measured it twice.
    sec = quick_run[0]["sections"]["9_loss_kernels"]
    assert sec["status"] == "ok", sec.get("traceback")
    fig = sec["figures"]
    assert {"torch@256", "chunked@256", "torch@64", "chunked@64"} <= set(fig["kernels"])
    assert set(fig["unavailable"]) == {"liger", "cut_ce"} and fig["pick"] in fig["kernels"]
    assert all(m["peak_bytes"] > 0 and m["seconds"] > 0 for m in fig["kernels"].values())


def test_set_overrides_one_size_and_refuses_what_is_not_a_size():
    bench = load_script()
    s = bench.with_overrides(bench.GPU, ["steps3=200", "plans3=1", "seq5=2048", "minutes=4.5", "sweep5=None"])
    assert (s.steps3, s.plans3, s.seq5, s.minutes, s.sweep5) == (200, 1, 2048, 4.5, None)
    assert s.target3 == bench.GPU.target3 and s.model == bench.GPU.model
    for bad, why in (("steps3", "FIELD=VALUE"), ("nope=1", "FIELD=VALUE"), ("model=1", "FIELD=VALUE"),
                     ("seq5=long", "takes a number")):
        with pytest.raises(SystemExit, match=why):
            bench.with_overrides(bench.GPU, [bad])


def test_minutes_spent_skips_the_rest_and_still_writes(tmp_path):
    bench = load_script()
    assert bench.main(["--quick", "--minutes", "0", "--sections", "1,2,6", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert [s["status"] for s in data["sections"].values()] == ["skipped"] * 3
    assert all("time limit" in s["reason"] for s in data["sections"].values())
    assert data["wall_seconds"] < 30 and data["png"] is None


def test_a_section_whose_time_runs_out_keeps_what_it_measured(tmp_path, monkeypatch):
    """Time runs out after section 2's first configuration: it stops there, keeps that row, lists the rest."""
    bench = load_script()
    clock = bench.Clock(None)
    ctx = bench.Ctx(bench.QUICK, True, clock, str(tmp_path))
    real = bench.probe_and_sweep

    def first_then_time_up(*args, **kwargs):
        row = real(*args, **kwargs)
        clock.end = time.monotonic() - 1.0
        return row

    monkeypatch.setattr(importlib.import_module("gpu_bench.s2_probe"), "probe_and_sweep", first_then_time_up)
    out = bench.section_probe(ctx)
    assert out["partial"] is True and len(out["figures"]["rows"]) == 1
    assert out["figures"]["rows"][0]["chosen_micro"] >= 1
    assert len(out["figures"]["not_run"]) == len(bench.QUICK.grid2) - 1
    assert all(r["reason"] == "time limit" for r in out["figures"]["not_run"])


@pytest.mark.parametrize("start", [1, 3, 7, 16])
@pytest.mark.parametrize("true_max", [0, 1, 2, 5, 7, 8, 15, 16])
def test_the_sweep_finds_the_largest_size_that_fits(true_max, start):
    """Sweep.largest against a size limit it does not know, from any starting guess, with sizes already measured."""
    bench = load_script()

    class Fake(bench.Sweep):
        def __init__(self, measured):
            self.rows, self.end, self.cut_short, self.ran = {}, None, False, []
            for m in measured:
                self.fits(m)

        def fits(self, micro):
            assert 1 <= micro <= 16
            if micro not in self.rows:
                self.ran.append(micro)
                self.rows[micro] = {"micro": micro, "fits": micro <= true_max}
            return self.rows[micro]["fits"]

    for measured in ([], [start], [1, start]):
        sweep = Fake(measured)
        assert sweep.largest(start, 16) == (true_max, true_max == 16)
        assert len(sweep.ran) == len(set(sweep.ran)) <= 12  # each size once, far fewer than a scan of 16


def test_the_grab_leaves_room_between_the_plan_and_the_next_smaller_micro_batch():
    from hf_accum.probing.loop import ProbeResult, Trial

    bench = load_script()
    GiB = 1 << 30
    line = ProbeResult([], 16, (10 * GiB, 1 * GiB), 80 * GiB, 80 * GiB, 16)
    assert bench.memory_between(line, 16, 8) == 22 * GiB  # between 18 GiB (8 rows) and 26 GiB (16 rows)
    one = ProbeResult([Trial(16, 20 * GiB, 26 * GiB, 1.0, True, "fits", baseline_bytes=10 * GiB)], 16, None,
                      80 * GiB, 80 * GiB, 16)
    assert bench.memory_between(one, 16, 8) == 22 * GiB  # 10 GiB + 16 GiB x 12 / 16


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.4), ("NVIDIA GH200 480GB", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA L40S", 362.1), ("NVIDIA L4", 121.0), ("Tesla V100-SXM2-16GB", None), ("cpu", None), (None, None),
])
def test_bf16_peak_by_device_name(name, tflops):
    got = flops.bf16_peak_flops(name)
    assert got == (None if tflops is None else pytest.approx(tflops * 1e12))


def test_training_flops_per_token_and_mfu():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    head_dim = 8
    per_layer = 16 * 16 + 2 * (16 * head_dim) + 16 * 16 + 3 * 16 * 40  # q, k and v (one KV head), o, MLP
    linear = 2 * per_layer + 16 * 100  # and the LM head; embeddings are no matrix product
    assert flops.linear_parameters(model) == linear
    assert flops.training_flops_per_token(model, 64) == 6 * linear + 12 * 2 * 16 * 64
    assert flops.mfu(1000.0, 2e9, 4e12) == pytest.approx(0.5)
    assert flops.mfu(1000.0, 2e9, None) is None


@pytest.mark.gpu
def test_gpu_sections_model_and_oom_on_cuda(tmp_path):
    """On a GPU: the real 1B model builds and a real OOM mid-run is recovered (the full run is the command)."""
    bench = load_script()
    assert bench.main(["--sections", "1,4", "--minutes", "4", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert all(s["status"] == "ok" for s in data["sections"].values())
    assert all(g["pass"] for g in data["sections"]["4_oom"]["goals"])


def test_the_gpu_model_is_a_1b_llama_and_its_sizes_fit_it():
    from transformers import LlamaConfig, LlamaForCausalLM

    gpu = load_script().GPU
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**gpu.model))
    params = sum(p.numel() for p in model.parameters())
    assert 1.1e9 < params < 1.4e9 and model.config.vocab_size == 128256 and model.config.hidden_size == 2048
    assert model.config.num_hidden_layers == 16
    assert max(gpu.seqs + (gpu.seq5, gpu.seq6)) <= model.config.max_position_embeddings
    assert gpu.minutes is not None and gpu.minutes < 9


def test_fused_chunks_quick_writes_every_size(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_fused_chunks",
                                                  os.path.join(ROOT, "benchmarks", "bench_fused_chunks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.redirect_stdout(io.StringIO()):
        assert module.main(["--quick", "--rows", "16,64", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "fused_chunks.json").read_text())
    assert set(data["fused"]) == {"16", "64"} and data["unfused"]["peak_bytes"] > 0
    assert all(m["seconds_per_step"] > 0 and m["peak_bytes"] > 0 for m in data["fused"].values())


def test_the_levers_sweep_records_an_oom_and_goes_on(tmp_path, monkeypatch):
    """An out-of-memory step at one grid point is recorded as "OOM", that level is not run at larger micro-batches,
    every other point still runs; any other error stops the sweep."""
    import dataclasses

    from hf_accum.compat import gradient_checkpointing

    bench = load_script()
    ctx = bench.Ctx(dataclasses.replace(bench.QUICK, micros8=(1, 2, 3)), True, bench.Clock(None), str(tmp_path))
    model = ctx.llama()
    real = bench.make_step_fn
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def failing_step_fn(model, opt, make_batch):
        step = real(model, opt, make_batch)

        def wrapped(micro):
            if micro >= 2 and gradient_checkpointing.checkpointed_count(model) == 0:
                raise error
            return step(micro)

        return wrapped

    monkeypatch.setattr(importlib.import_module("gpu_bench.s8_levers"), "make_step_fn", failing_step_fn)
    levels = [("none", 0), ("full", 2)]
    rows, not_run = bench.lever_sweep(ctx, model, 16, levels, end=time.monotonic() + 600)
    got = {(r["level"], r["micro"]): r["result"] for r in rows}
    assert got == {("none", 1): "ok", ("full", 1): "ok", ("none", 2): "OOM", ("full", 2): "ok", ("full", 3): "ok"}
    assert not_run == [{"level": "none", "layers": 0, "micro": 3, "reason": "OOM at micro 2"}]
    assert gradient_checkpointing.checkpointed_count(model) == 0  # every level's context restored the model
    error = ValueError("a shape error is no OOM")
    with pytest.raises(ValueError, match="no OOM"):
        bench.lever_sweep(ctx, model, 16, levels, end=time.monotonic() + 600)
