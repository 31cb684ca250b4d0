"""The estimate (fake tensors, nothing allocated) against the probe's measured CPU peak, like for like."""

import json

import pytest
import torch

from hf_accum.probing.estimate import interpolate
from hf_accum.probing.estimate_check import against_probe
from hf_accum.probing.paper import parse_size, with_lora

MiB = 2**20


def _config(arch: str):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    if arch == "llama":
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    if arch == "gpt2":
        return GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512)
    return Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _builder(arch: str, lora: bool):
    from transformers import AutoModelForCausalLM

    config = _config(arch)
    build = lambda: AutoModelForCausalLM.from_config(config)  # noqa: E731
    return with_lora(build, 8, None) if lora else build


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_estimate_within_5_percent_of_the_cpu_probe(arch, lora):
    # a budget the real probe fills at a handful of rows, so the search measures several sizes
    rows, measured_max, estimated_max, est = against_probe(_builder(arch, lora), seq_len=128, target_batch_size=8,
                                                           budget_bytes=12 * MiB)
    assert len(rows) >= 2
    for row in rows:
        assert abs(row.error) <= 0.05, (arch, lora, row)
    assert estimated_max == measured_max
    assert 1 <= measured_max < 8
    assert sorted(est.peaks)[: measured_max + 1] == list(range(1, measured_max + 2))


def test_all_peaks_false_steps_only_the_searched_sizes_and_also_and_they_are_the_same_peaks():
    """The tests that compare with a real probe read only the sizes it measured: all_peaks=False with ``also`` steps
    those and no others, and each is the peak the every-size estimate gives it."""
    from hf_accum.probing.estimate import estimate_model

    kwargs = dict(seq_len=128, target_batch_size=8, device="cpu", device_memory=64 * 2**30, budget_bytes=12 * MiB)
    every = estimate_model(_builder("llama", True), **kwargs)
    searched = set(estimate_model(_builder("llama", True), all_peaks=False, **kwargs).peaks)
    also = (1, every.result.max_micro_batch_size + 1)
    some = estimate_model(_builder("llama", True), all_peaks=False, also=also, **kwargs)
    assert set(some.peaks) == searched | set(also) != set(every.peaks)
    assert all(some.peaks[m] == every.peaks[m] for m in some.peaks)


@pytest.mark.parametrize("points, last, expected", [
    ({1: 10, 2: 20}, 2, {1: 10, 2: 20}),
    ({1: 10, 2: 20, 5: 50}, 5, {1: 10, 2: 20, 3: 30, 4: 40, 5: 50}),
    ({1: 10, 3: 31}, 3, {1: 10, 2: 20, 3: 31}),  # rounded to the byte
])
def test_interpolate(points, last, expected):
    assert interpolate(points, last) == expected


@pytest.mark.parametrize("text, expected", [("80GiB", 80 * 2**30), ("24GB", 24 * 10**9), ("1.5 GiB", 3 * 2**29),
                                            ("1024B", 1024), ("17179869184", 16 * 2**30), ("512mib", 512 * MiB)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["80 parsecs", "", "-1GiB", "0"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="--device-memory"):
        parse_size(text)


@pytest.mark.parametrize("text", ["80", "1024", "24.5"])
def test_a_size_with_no_unit_below_a_mebibyte_asks_for_the_unit(text):
    """Issue 59, item 7: `--device-memory 80` was read as 80 bytes and answered with advice about checkpointing."""
    with pytest.raises(ValueError, match=rf"^--device-memory='{text}' has no unit and reads as \d+ bytes: did you "
                                         rf"mean {text}GiB\? Give the unit"):
        parse_size(text)


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    _config("gpt2").save_pretrained(folder)  # config.json only: no weights exist to load
    return str(folder)


def test_cli_estimate_writes_the_plan_with_every_peak(gpt2_folder, tmp_path, capsys):
    from hf_accum.cli import main

    out = tmp_path / "plan.json"
    code = main(["probe", "--estimate", "--model", gpt2_folder, "--device", "cpu", "--device-memory", "1GiB",
                 "--seq-len", "64", "--target-batch", "8", "--budget-bytes", str(8 * MiB), "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["estimated"] is True
    largest = data["max_micro_batch_size"]
    assert 1 <= largest < 8
    peaks = {int(k): v for k, v in data["peaks"].items()}
    assert sorted(peaks) == list(range(1, largest + 2))
    assert peaks[largest] <= 8 * MiB < peaks[largest + 1]
    assert all(peaks[m] < peaks[m + 1] for m in range(1, largest + 1))
    assert data["trials"] and all(t["seconds"] is None for t in data["trials"])  # fake steps time nothing
    said = capsys.readouterr()
    assert "predicted peak per micro-batch" in said.out
    # nothing trained: the search's first line does not call its steps real (issue 59's replay of a new user)
    search = next(line for line in (said.out + said.err).splitlines() if "searching the largest micro-batch" in line)
    assert "training step on fake tensors (nothing runs)" in search and "real training step" not in search


def test_cuda_estimate_on_a_cpu_build_says_its_assumptions(gpt2_folder):
    from hf_accum import estimate

    kwargs = dict(seq_len=64, target_batch_size=4, device_memory="1GiB", budget_bytes=512 * MiB)
    cuda = estimate(gpt2_folder, device="cuda", **kwargs)
    cpu = estimate(gpt2_folder, device="cpu", **kwargs)
    assert cuda.assumptions and not cpu.assumptions
    assert torch.cuda.is_available() or cuda.result.device.startswith("cuda")
    # the same step, each block rounded up to the CUDA allocator's 512 bytes: never less
    assert all(cuda.peaks[m] >= cpu.peaks[m] for m in cpu.peaks)
    assert cuda.plan.micro_batch_size == cpu.plan.micro_batch_size == 4


@pytest.mark.parametrize("flags, words", [
    (["--device-memory", "lots"], "--device-memory"),
    (["--gradient-checkpointing", "--checkpoint-layers", "1"], "contradict"),  # checkpointing itself is estimated
])
def test_cli_estimate_refuses_in_one_line(gpt2_folder, capsys, flags, words):
    from hf_accum.cli import main

    code = main(["probe", "--estimate", "--model", gpt2_folder, *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and words in err


def test_cli_estimate_of_a_missing_model_is_one_line(tmp_path, capsys, monkeypatch):
    """A path that does not exist (or a hub id not in the offline cache) is one line and exit 2, as without
    --estimate; it was a 47-line OSError traceback."""
    from hf_accum.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["probe", "--estimate", "--model", str(tmp_path / "nonexistent"), "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "--model=" in err and "is a path, but there is no such directory" in err


def test_cli_estimate_names_the_weights_dtype(gpt2_folder, tmp_path, capsys):
    """--bf16 is autocast only: the weights keep the config's dtype, and the header says which (an 8B config without
    a dtype estimates float32 weights, twice the bytes)."""
    from hf_accum.cli import main

    code = main(["probe", "--estimate", "--model", gpt2_folder, "--device", "cpu", "--device-memory", "1GiB",
                 "--seq-len", "32", "--target-batch", "2", "--budget-bytes", str(8 * MiB)])
    assert code == 0
    assert "weights float32 (the config names no dtype)" in capsys.readouterr().out


# --- issue 42 item 16: --estimate's words and defaults -----------------------------------------------------------
@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cli_estimate_defaults_to_this_machines_device_and_names_where_the_memory_came_from(gpt2_folder, capsys,
                                                                                             no_gpu):
    from hf_accum.cli import main

    code = main(["probe", "--estimate", "--model", gpt2_folder, "--seq-len", "32", "--target-batch", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"estimating {gpt2_folder} for cpu with " in out
    assert "(of this machine's cpu memory)" in out and "(of --device-memory)" not in out
    progress = [line.strip() for line in out.splitlines() if line.strip().startswith("micro-batch ")]
    assert progress and all(line.endswith(("MiB, fits", "MiB, over budget")) for line in progress), progress
    assert not any(" GiB" in line or " s," in line for line in progress)  # the table's unit; no step seconds


def test_cli_estimate_for_cuda_on_a_machine_without_one_needs_the_cards_size(gpt2_folder, capsys, no_gpu):
    from hf_accum.cli import main

    assert main(["probe", "--estimate", "--model", gpt2_folder, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hf-accum probe: an estimate for cuda on a machine without a GPU needs --device-memory, the "
                   "card's memory (e.g. 80GiB)"]


@pytest.mark.parametrize("flags,words", [
    (["--device", "cuda"], "--device is for --estimate (the device planned for, nothing loaded); the probe "
                           "measures the device it runs on: add --estimate, or drop --device"),
    (["--device-memory", "80GiB"], "--device-memory is for --estimate"),
])
def test_cli_estimate_flags_are_not_ignored_or_misnamed(flags, words, capsys):
    from hf_accum.cli import main

    assert main(["probe", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_python_estimate_assumes_no_card_size(gpt2_folder, no_gpu):
    from hf_accum import estimate
    from hf_accum.probing.meters import CpuMeter

    with pytest.raises(ValueError, match="an estimate for cuda on a machine without a GPU needs device_memory"):
        estimate(gpt2_folder, device="cuda", seq_len=32, target_batch_size=2)
    est = estimate(gpt2_folder, seq_len=32, target_batch_size=2)  # this machine's device and memory
    assert est.device == "cpu" and est.result.capacity_bytes == CpuMeter().capacity_bytes()


def test_a_negative_intercept_is_not_printed_as_a_negative_peak():
    from hf_accum.probing.loop import ProbeResult
    from hf_accum.probing.plan import plan_batch
    from hf_accum.probing.report import summary

    result = ProbeResult([], 4, (-9.1 * MiB, 132.3 * MiB), 1024 * MiB, 2048 * MiB, 4, device="cpu")
    text = summary(result, plan_batch(8, 1, 4), 256)
    assert "-9.1" not in text and "≈ -" not in text
    assert "memory model: peak grows 132.3 MiB per micro-batch row (seq 256; the fitted line crosses zero" in text
    ok = summary(ProbeResult([], 4, (9.1 * MiB, 132.3 * MiB), 1024 * MiB, 2048 * MiB, 4), plan_batch(8, 1, 4), 256)
    assert "memory model: peak ≈ 9.1 MiB + 132.3 MiB × micro-batch (seq 256)" in ok


def test_probe_from_estimate_takes_a_bool(tmp_path):
    from hf_accum import AccumTrainingArguments

    with pytest.raises(ValueError, match="probe_from_estimate='yes' must be True or False"):
        AccumTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], probe_from_estimate="yes")


def test_every_peak_starts_from_a_warmed_optimizer_only_where_its_state_is_a_warm_up_s():
    """`every_peak` skips its warm-up step only where the probe's optimizer holds what that step would create: a
    float32 step and two moments per parameter, shaped and typed as it, and the parameter's gradient."""
    from hf_accum.probing.estimate import same_state

    def stepped(**kwargs):
        p = torch.nn.Parameter(torch.zeros(3, 2))
        opt = torch.optim.AdamW([p], **kwargs)
        p.grad = torch.zeros_like(p)
        opt.step()
        return opt, p

    for kwargs in ({}, {"foreach": True}, {"fused": True}):
        opt, p = stepped(**kwargs)
        assert same_state(opt, [p]), kwargs
    opt, p = stepped(amsgrad=True)  # a third moment: not what the device's AdamW creates
    assert not same_state(opt, [p])
    opt, p = stepped()
    p.grad = None
    assert not same_state(opt, [p])  # no gradient: the warm-up would allocate it
    assert not same_state(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]), [p])  # no state yet
