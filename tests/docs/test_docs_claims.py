"""What the manual says a user can rely on is what the code does (issue 39, "The claims stay true"): the plot extra
is named before the first command that plots; a stored plan's key is what "When a stored plan is reused" lists; a
second signal does what "Stopping and resuming" says; the argument checks it lists fail when the arguments are built,
and `--plot` without matplotlib fails before any model is loaded."""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.doc_blocks import ROOT, blocks, pages, read


def _flat(text: str) -> str:
    return " ".join(text.split())


def _section(page: str, heading: str) -> str:
    return _flat(read(page).split(heading + "\n", 1)[1].split("\n## ", 1)[0])


def test_the_plot_extra_is_named_before_the_first_command_that_plots():
    for page in ["README.md", *pages()]:
        text = read(page)
        plotting = [b for b in blocks(page) if "--plot" in b.code and not b.skip]
        if plotting:
            first = plotting[0]
            before = "\n".join(text.splitlines()[: first.line])
            assert '".[plot]"' in before or "hf-accum[plot]" in before, f"{page}: --plot at line {first.line}"


KEY_WORDS = {  # plan-key field (planning/store.py key_fields) -> how "When a stored plan is reused" names it
    "device": "the device", "capacity_bytes": "its total capacity", "model_class": "the model's class",
    "model_config": "config", "attn_implementation": "attention implementation", "param_dtypes": "parameter dtypes",
    "trainable_parameters": "trainable parameter count", "peft": "a LoRA config", "seq_len": "the sequence length",
    "bf16": "`bf16`", "fp16": "`fp16`", "gradient_checkpointing": "`gradient_checkpointing`",
    "checkpoint_layers": "`checkpoint_layers`", "levers": "`levers`", "fused_loss": "whether the fused loss runs",
    "optim": "the optimizer", "optim_args": "the optimizer and its arguments", "max_grad_norm": "`max_grad_norm`",
    "budget": "the budget *as requested*", "probe_max_micro_batch": "`probe_max_micro_batch`",
    "target_batch_size": "the target", "world_size": "the world size", "engine": "the engine",
    "optimize": "`auto_tune_optimize`", "micro_batching": "`micro_batching`",
    "versions": "the installed version of hf-accum, torch, transformers, peft (for a PEFT model) or bitsandbytes (for "
                "a quantized one)",
}


def test_the_reuse_section_names_every_field_of_the_plan_key():
    from hf_accum.planning import store

    source = inspect.getsource(store.key_fields)
    fields = re.findall(r'^\s+"(\w+)":', source, re.M)
    assert set(fields) == set(KEY_WORDS), set(fields) ^ set(KEY_WORDS)
    assert "libraries_that_matter(model)" in source
    libraries = re.findall(r'"([\w-]+)"', inspect.getsource(store.libraries_that_matter))
    assert [name for name in libraries if name in ("hf-accum", "torch", "transformers", "peft", "bitsandbytes")] == [
        "hf-accum", "torch", "transformers", "peft", "bitsandbytes"]
    section = _section("docs/plan.md", "## When a stored plan is reused, and when it is not")
    for field, words in KEY_WORDS.items():
        assert words in section, (field, words)
    assert "reuses the stored plan without probing" in section and "probes again" in section


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM])
def test_after_the_first_signal_a_ctrl_c_raises_and_a_sigterm_changes_nothing(first):
    from hf_accum.trainer.resilience.preemption import StoppedAtOnce, StopRequest

    stop, before = StopRequest(), signal.getsignal(signal.SIGINT)
    with stop.installed():
        os.kill(os.getpid(), first)
        deadline = time.monotonic() + 5
        while not stop and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.signal_name == first.name  # recorded: training goes on to the end of the step
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM: the stop already asked for goes on
        time.sleep(0.05)
        assert stop.signal_name == first.name
        with pytest.raises(StoppedAtOnce):  # a KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert signal.getsignal(signal.SIGINT) is before
    text = _section("docs/stopping.md", "## Preemption (SIGTERM) and Ctrl-C")
    assert issubclass(StoppedAtOnce, KeyboardInterrupt)
    text = " ".join(text.split())
    assert "a second Ctrl-C raises `StoppedAtOnce` (a `KeyboardInterrupt`)" in text and "A second SIGTERM changes nothing" in text


@pytest.mark.parametrize("setting, name", [
    ({"target_batch_size": 0}, "target_batch_size"),
    ({"max_steps": -3}, "max_steps"),
    ({"num_train_epochs": 0}, "num_train_epochs"),
    ({"learning_rate": -1.0}, "learning_rate"),
])
def test_the_argument_checks_the_manual_lists_fail_when_the_arguments_are_built(setting, name, tmp_path):
    from hf_accum import AccumTrainingArguments

    listed = _section("docs/exactness.md", "## What is refused, and when").split("2. **When the trainer is built**")[0]
    assert name in listed
    with pytest.raises(ValueError, match=name):
        AccumTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **setting)


def test_plot_without_matplotlib_fails_before_a_model_is_loaded(tmp_path):
    script = ("import sys; sys.modules['matplotlib'] = None; sys.modules['matplotlib.backend_bases'] = None; "
              "from hf_accum.cli import main; "
              "rc = main(['probe', '--model', 'tiny', '--plot', 'p.png']); print('rc', rc)")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert "rc 2" in done.stdout, done.stdout + done.stderr
    assert "--plot needs matplotlib (the plot extra): pip install matplotlib" in done.stderr
    assert "loading" not in done.stdout + done.stderr and not os.listdir(tmp_path)
    quick = _flat(read("docs/quickstart.md"))
    assert "--plot needs matplotlib (the plot extra): pip install matplotlib" in quick
