"""`hf-accum probe RECIPE` measures what `hf-accum train RECIPE` trains and stores the plan it reuses; a resumed
run continues from the newest checkpoint without rewriting older ones; a refused rerun changes nothing on disk
and is refused before any model is built. Through the entry point, on the tiny offline recipes (CPU)."""

import json
import os
import shutil

import pytest
import torch

from hf_accum.cli import main
from tests.conftest import another_hash_seed

PLAN_FILE = "hf_accum_plan.json"


def snapshot(folder):
    """Every file under ``folder``: (modification time, bytes)."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = (os.stat(path).st_mtime_ns, f.read())
    return out


@pytest.mark.parametrize("recipe", ["lora_sft", "qlora_sft"])
def test_probe_recipe_stores_the_plan_that_train_reuses(recipe, tmp_path, capsys, caplog):
    if recipe == "qlora_sft":
        pytest.importorskip("bitsandbytes")
    out = tmp_path / "run"
    assert main(["probe", recipe, f"output_dir={out}", "--json", str(tmp_path / "probe.json")]) == 0
    printed = capsys.readouterr().out
    assert "| micro | peak alloc MiB" in printed and "plan: micro" in printed
    assert f"stored the plan in {out / PLAN_FILE}" in printed
    assert sorted(os.listdir(out)) == [PLAN_FILE]  # the probe writes the plan and nothing else
    stored = json.loads((out / PLAN_FILE).read_text())
    assert stored["probe"]["trials"] and stored["plan"]["gradient_accumulation_steps"] > 1
    assert json.loads((tmp_path / "probe.json").read_text())["micro_batch_size"] == stored["plan"]["micro_batch_size"]

    caplog.clear()
    assert main(["train", recipe, "max_steps=2", "disable_tqdm=true", f"output_dir={out}"]) == 0
    captured = capsys.readouterr()
    # Reused only when the plan key (model, dtypes, LoRA, quantization, checkpointing, sequence length, optimizer,
    # budget, target) of what train built equals the probe's: the probe measured what the run trains. The one plan
    # line says so (shown by the tuner; the recipe does not print the plan a second time).
    # (under pytest the warning goes to caplog; without logging set up, Python prints it to stderr)
    lines = (captured.out + captured.err).splitlines() + [r.getMessage() for r in caplog.records]
    shown = [line for line in lines if line.startswith("hf_accum plan: ")]
    assert len(shown) == 1 and "; stored plan (reused " in shown[0]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["reused_stored_plan"] is True and summary["probe"]["reused_stored_plan"] is True
    assert summary["plan"] == stored["plan"] and summary["steps"] == 2
    assert json.loads((out / PLAN_FILE).read_text())["key"] == stored["key"]


def test_probe_recipe_without_output_dir_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["probe", "lora_classification"]) == 0
    assert "plan not stored: add output_dir=DIR" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []


def run_args(out, *extra):
    return ["train", "lora_sft", "save_steps=2", "logging_steps=1", "disable_tqdm=true", "lr_scheduler_type=constant",
            "warmup_steps=0", "learning_rate=5e-3", f"output_dir={out}", *extra]


def test_a_resumed_run_continues_from_the_newest_checkpoint_without_rewriting_older_ones(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(run_args(out, "max_steps=4")) == 0  # save_steps alone: the recipe's save_strategy "no" -> steps
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    older = snapshot(out / "checkpoint-2") | {f"4/{k}": v for k, v in snapshot(out / "checkpoint-4").items()}
    everything = snapshot(out)

    # Without resume, a new run would start at step 0 over these checkpoints: refused, nothing touched.
    capsys.readouterr()
    assert main(run_args(out, "max_steps=6")) == 2
    assert "holds checkpoints of an earlier run (newest: checkpoint-4)" in capsys.readouterr().err
    assert snapshot(out) == everything

    assert main(run_args(out, "max_steps=6", "resume_from_checkpoint=true")) == 0
    printed = capsys.readouterr().out
    assert f"resuming from {out / 'checkpoint-4'}" in printed
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["resumed_from"] == str(out / "checkpoint-4") and summary["steps"] == 6
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert snapshot(out / "checkpoint-2") | {f"4/{k}": v for k, v in snapshot(out / "checkpoint-4").items()} == older
    resumed = {h["step"]: h["loss"] for h in summary["losses"]}

    # The same trajectory as a run never stopped. It starts from the plan the first run probed and stored (a copy of
    # its plan file, whose key names no folder): the same plan, without probing it a second time.
    (tmp_path / "straight").mkdir()
    shutil.copy(out / PLAN_FILE, tmp_path / "straight")
    assert main(run_args(tmp_path / "straight", "max_steps=6")) == 0
    assert json.loads((tmp_path / "straight" / "run_summary.json").read_text())["reused_stored_plan"] is True
    straight = {h["step"]: h["loss"] for h in json.loads((tmp_path / "straight" / "run_summary.json").read_text())[
        "losses"]}
    assert sorted(resumed) == sorted(straight) == [1, 2, 3, 4, 5, 6]
    for step in (5, 6):  # trained after the resume
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), (resumed, straight)


def test_a_rerun_with_another_target_changes_nothing_and_is_refused_before_any_model_work(tmp_path, capsys,
                                                                                         monkeypatch):
    out = tmp_path / "run"
    assert main(["train", "lora_classification", "max_steps=1", "disable_tqdm=true", f"output_dir={out}"]) == 0
    before = snapshot(out)
    assert {"recipe.yaml", PLAN_FILE, "run_summary.json", "adapter_model.safetensors"} <= set(before)

    def no_model_work(*args, **kwargs):
        raise AssertionError("a model was built for a run that had to be refused")

    monkeypatch.setattr("hf_accum.recipes.run.build", no_model_work)
    capsys.readouterr()
    for command in ("train", "probe"):
        assert main([command, "lora_classification", "target_batch_size=32", f"output_dir={out}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"hf-accum {command}: output_dir='{out}' holds a run planned for target_batch_size=16")
        assert "keep target_batch_size=16 to continue it, or pass output_dir=ANOTHER_DIR" in err
    assert main(["train", "lora_classification", "resume_from_checkpoint=true", f"output_dir={out}"]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err
    assert snapshot(out) == before


@pytest.mark.parametrize("preparation,upcast", [("light", False), ("peft", True)])
def test_the_one_lora_builder_upcasts_a_quantized_base_only_when_asked(preparation, upcast):
    """`hf-accum probe --lora --load-in-4bit` and the recipes share loading.add_lora: by default the non-quantized
    weights keep their dtype (peft's prepare_model_for_kbit_training would make them float32)."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig

    from hf_accum import tiny
    from hf_accum.probing.loading import add_lora, load_model

    quantization = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.bfloat16}
    model = load_model("tiny", quantization=quantization, dtype=torch.bfloat16, device="cpu",
                       tokenizer=tiny.build_tokenizer())
    lora = LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")
    model = add_lora(model, lora, quantized=True, kbit_preparation=preparation, checkpointing=True)
    base = {p.dtype for n, p in model.named_parameters() if "lora_" not in n and p.dtype.is_floating_point}
    assert base == ({torch.float32} if upcast else {torch.bfloat16})
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def cli(*argv, seed):
    import subprocess
    import sys

    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    return subprocess.run([sys.executable, "-m", "hf_accum.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.mark.slow
def test_probe_and_train_in_two_processes_reuse_the_plan(tmp_path, capsys):
    # The probe in this process, the training in a fresh `python -m hf_accum.cli` whose hash seed orders peft's set
    # of target modules (LoraConfig's set of the recipe's list) otherwise than this process does: one launch, not
    # two, for two processes and two orders.
    from hf_accum.recipes import load_recipe

    modules = load_recipe("lora_sft", []).lora["target_modules"]
    out = tmp_path / "run"
    assert main(["probe", "lora_sft", f"output_dir={out}"]) == 0
    key = json.loads((out / PLAN_FILE).read_text())["key"]
    assert key["peft"]["default"]["target_modules"] == sorted(modules)  # the set the seed is chosen for
    train = cli("train", "lora_sft", "max_steps=1", "disable_tqdm=true", f"output_dir={out}",
                seed=another_hash_seed(modules, list(set(modules))))
    assert train.returncode == 0, train.stderr
    assert json.loads((out / "run_summary.json").read_text())["reused_stored_plan"] is True


def test_lora_sft_trains_packed(tmp_path, capsys):
    """`hf-accum train lora_sft packing=true` (TRL's BFD packing: padding-free rows with seq_lengths) trains; the
    probe once died on a packed row shortened without its last packed sequence (issue 46)."""
    out = tmp_path / "packed"
    argv = ["train", "lora_sft", "packing=true", "data.num_examples=200", "max_steps=2", "logging_steps=1",
            "disable_tqdm=true", f"output_dir={out}"]
    assert main(argv) == 0
    assert "2 steps in" in capsys.readouterr().out and (out / "adapter_model.safetensors").is_file()
    assert json.loads((out / PLAN_FILE).read_text())["plan"]["target_batch_size"] == 16
