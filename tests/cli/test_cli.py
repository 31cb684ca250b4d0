import os
import re
import subprocess
import sys
import time

from hf_accum import __version__
from hf_accum.cli import main


def test_version_from_console_script():
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "hf_accum.cli", "--version"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"hf-accum {__version__}"
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in out.stderr.splitlines()
                if line.startswith("import time:")}
    assert "hf_accum" in imported and not imported & {"torch", "transformers", "peft", "trl", "datasets"}


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "probe" in capsys.readouterr().out


def test_probe_default_run_plans_accumulation(tmp_path, capsys):
    import json

    out_json, out_png = tmp_path / "plan.json", tmp_path / "curve.png"
    assert main(["probe", "--seq-len", "64", "--json", str(out_json), "--plot", str(out_png)]) == 0
    printed = capsys.readouterr().out
    assert "| micro | peak alloc MiB" in printed and "plan: micro" in printed and "memory model" in printed
    data = json.loads(out_json.read_text())
    for key in ("micro_batch_size", "gradient_accumulation_steps", "world_size", "target_batch_size",
                "max_micro_batch_size", "budget_bytes", "capacity_bytes", "device", "trials"):
        assert key in data
    assert data["micro_batch_size"] * data["gradient_accumulation_steps"] * data["world_size"] == 32
    assert data["gradient_accumulation_steps"] > 1
    assert {"micro_batch_size", "peak_bytes", "fits", "seconds"} <= set(data["trials"][0])
    fitting = [t["peak_bytes"] for t in data["trials"] if t["fits"]]
    assert fitting and max(fitting) <= data["budget_bytes"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_probe_chooses_the_checkpointing_level(tmp_path, capsys):
    import json

    out_json = tmp_path / "plan.json"
    assert main(["probe", "--seq-len", "256", "--checkpoint-layers", "auto", "--budget-bytes", str(16_000_000),
                 "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "| checkpointed layers | micro |" in printed and "checkpointing 2 of 2 layers: largest measured fit" in printed
    assert re.search(r"chosen: checkpointing \d of 2 layers, \d+ forwards", printed)
    data = json.loads(out_json.read_text())
    assert data["levers"]["checkpointing"]["of"] == 2 and {t["checkpointed_layers"] for t in data["trials"]} == {0, 2}
    assert main(["probe", "--checkpoint-layers", "3"]) == 2
    assert "--checkpoint-layers 3: give 'auto' or an integer 0..2" in capsys.readouterr().err


import pytest  # noqa: E402


def error_line(capsys) -> str:
    """The one line a user error prints on stderr (and nothing else there)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--budget", "1.5"], "--budget=1.5 must be a fraction in (0, 1]"),
        (["--budget-bytes", "0"], "--budget-bytes=0 must be a positive integer"),
        (["--target-batch", "9", "--world-size", "2"], "use --target-batch 8 or 10"),
        (["--seq-len", "0"], "--seq-len=0 must be a positive integer"),
        (["--seq-len", "abc"], "argument --seq-len: invalid int value: 'abc'"),
        (["--estimate", "--device-memory", "-5GiB"], "--device-memory='-5GiB': give a positive size such as 80GiB"),
        (["--seq-len", "-5"], "--seq-len=-5 must be a positive integer"),
        (["--model", "/nonexistent/model-dir"], "model='/nonexistent/model-dir' is a path, but there is no such "
                                                "directory"),  # not a hub id (issue 42, item 9)
        (["--model", "nonexistent-model-dir"], "model='nonexistent-model-dir' could not be loaded as a hub id"),
        (["--seq-len", "5000"], "exceeds the model's max_position_embeddings=4096; set --seq-len <= 4096"),
        (["--budget-bytes", "100000"], "even micro-batch 1 does not fit"),
        (["--json", "/nonexistent-dir/p.json"], "--json=/nonexistent-dir/p.json: /nonexistent-dir is not a writable"),
        (["--plot", "curve.txt"], "--plot=curve.txt: the file name must end in an image type"),
        (["lora_sft", "--model", "tiny2"], "--model is for a bare model; with a recipe use model=..."),
        (["max_steps=3"], "looks like an override; give the recipe first"),
    ],
)
def test_probe_bad_input_is_one_line_with_the_fix_and_exit_2(argv, message, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["probe", *argv]) == 2
    line = error_line(capsys)
    assert line.startswith("hf-accum probe: ") and message in line, line


def test_quantization_without_bitsandbytes_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if not installed
    assert main(["probe", "--load-in-4bit"]) == 2
    assert re.search(r"needs bitsandbytes, which is not installed.*pip install 'bitsandbytes>=0.45' \(the qlora extra", error_line(capsys))


def test_8bit_on_a_machine_without_cuda_is_refused_before_loading(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: 8-bit is allowed")
    assert main(["probe", "--load-in-8bit"]) == 2
    assert re.search("8-bit .* needs a CUDA GPU; on CPU use --load-in-4bit", error_line(capsys))


# --- the process: fast start, one-line errors, --debug ----------------------------------------------------
HEAVY = ("torch", "transformers", "peft", "bitsandbytes", "datasets")


def run_cli(code: str, env=None, timeout=300):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["probe", "--help"], ["probe", "--budget", "2"],
                                  ["trian"], ["train"]])
def test_help_and_argument_errors_import_nothing_heavy(argv):
    code = (f"import sys, time; t = time.perf_counter(); from hf_accum.cli import main\n"
            f"try:\n    rc = main({argv!r})\nexcept SystemExit as e:\n    rc = e.code\n"
            f"print('RESULT', rc, time.perf_counter() - t, [m for m in {HEAVY!r} if m in sys.modules])")
    out = run_cli(code)
    rc, seconds, heavy = out.stdout.split("RESULT")[1].split(maxsplit=2)
    assert heavy.strip() == "[]", heavy  # what makes `hf-accum --help` take seconds
    assert int(rc) == (0 if "--help" in argv else 2)
    if rc != "0":
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr


def test_a_user_error_is_one_line_and_debug_shows_the_traceback():
    plain = subprocess.run([sys.executable, "-m", "hf_accum.cli", "train", "lora_sft", "max_steps=abc"],
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode == 2 and plain.stdout == ""
    assert plain.stderr.strip().splitlines() == [
        "hf-accum train: training.max_steps='abc' is a string, but training.max_steps takes an integer; set it to "
        "such a value (e.g. max_steps=8)"]
    debug = subprocess.run([sys.executable, "-m", "hf_accum.cli", "train", "lora_sft", "max_steps=abc", "--debug"],
                           capture_output=True, text=True, timeout=300)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "RecipeError" in debug.stderr


@pytest.mark.parametrize("recipe,imported", [("lora_sft", False), ("qlora_sft", True)])
def test_bitsandbytes_is_imported_only_when_the_command_quantizes(recipe, imported):
    pytest.importorskip("bitsandbytes")
    code = (f"import sys; sys.argv = ['hf-accum', 'train', {recipe!r}, '--print-config']\n"
            "from hf_accum.cli import main\nrc = main(); print('RESULT', rc, sys.modules.get('bitsandbytes') is not None)")
    out = run_cli(code)
    assert out.stdout.split("RESULT")[1].split() == ["0", str(imported)], out.stderr
    if not imported:
        assert "bitsandbytes" not in out.stderr and "kernels" not in out.stderr, out.stderr


def test_an_unreachable_hub_fails_fast_with_the_offline_hint(monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: refused at once
    start = time.perf_counter()
    assert main(["train", "lora_sft", "model=someone/some-model"]) == 2
    line = error_line(capsys)
    assert "model.name='someone/some-model'" in line and "hub (http://127.0.0.1:9) is not reachable" in line
    assert "Set HF_HUB_OFFLINE=1" in line and "local directory" in line
    assert main(["probe", "--model", "someone/some-model"]) == 2
    assert "Set HF_HUB_OFFLINE=1" in error_line(capsys)
    assert time.perf_counter() - start < 60  # huggingface_hub alone retried for ~57 s per load


@pytest.mark.parametrize("argv,recipe,overrides", [
    (["probe", "lora_sft", "--json", "x.json", "output_dir=y"], "lora_sft", ["output_dir=y"]),
    (["train", "lora_sft", "a=1", "--print-config", "b=2"], "lora_sft", ["a=1", "b=2"]),
    (["probe", "--json", "x.json", "lora_sft", "a=1"], "lora_sft", ["a=1"]),
])
def test_overrides_may_follow_flags(argv, recipe, overrides):
    from hf_accum.cli import _parse, build_parser

    args = _parse(build_parser(), argv)
    assert (args.recipe, args.overrides) == (recipe, overrides)


def test_an_unknown_flag_is_one_line(capsys):
    assert main(["train", "lora_sft", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in error_line(capsys)


def test_train_without_a_recipe_asks_for_the_recipe_only(capsys):
    """Overrides are optional (`hf-accum train lora_sft` runs): the error named `key=value` as required too (argparse
    counts a nargs='*' positional without a default as required; issue 59's replay)."""
    assert main(["train"]) == 2
    line = error_line(capsys)
    assert "the following arguments are required: recipe (" in line and "key=value" not in line


def test_probe_budget_errors_name_the_flags(capsys):
    assert main(["probe", "--seq-len", "16", "--budget-bytes", str(2**60)]) == 2
    line = error_line(capsys)
    assert f"--budget-bytes={2**60} " in line and "Set --budget instead" in line


@pytest.mark.parametrize("flags,absent,present", [
    (["--lora", "--gradient-checkpointing"], ["enable gradient checkpointing", "train LoRA"],
     ["load the base model in 4-bit (QLoRA), shorten the probe sequence length, or raise the memory budget"]),
    (["--lora"], ["train LoRA"], ["To fit: enable gradient checkpointing, load the base model in 4-bit"]),
    ([], [], ["To fit: enable gradient checkpointing, train LoRA adapters instead of all weights, load the base"]),
])
def test_nothing_fits_suggests_only_the_levers_that_are_off(flags, absent, present, monkeypatch, capsys):
    """Issue 42 item 12: a run with checkpointing and LoRA on was told to enable them."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["probe", "--budget-bytes", "1000", "--seq-len", "32", "--target-batch", "4", *flags]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]  # (transformers notes use_cache=False before it)
    assert line.startswith("hf-accum probe: even micro-batch 1 does not fit")
    assert all(text not in line for text in absent) and all(text in line for text in present), line


@pytest.mark.parametrize("estimate", [[], ["--estimate"]])
def test_contradicting_checkpointing_flags_are_refused_before_the_model_loads(monkeypatch, capsys, estimate):
    """Checked with the other arguments: the probe used to load the model first, then refuse."""
    from hf_accum.probing import loading

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(loading, "load_model", no_load)
    assert main(["probe", *estimate, "--gradient-checkpointing", "--checkpoint-layers", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "contradict each other: give one" in err


def test_the_tiny_model_is_estimated_as_any_other(capsys):
    """Issue 59, item 18: `--estimate --model tiny` was refused ("the built-in tiny model has none [config.json]"),
    though the tiny model is built from a config in code; its config is the model's own."""
    from hf_accum import tiny
    from hf_accum.probing.paper import load_config

    assert load_config("tiny").to_dict() == tiny.build_model().config.to_dict()
    assert main(["probe", "--estimate", "--model", "tiny", "--device", "cpu", "--device-memory", "1GiB",
                 "--seq-len", "64", "--target-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "estimating tiny for cpu with 1.0 GiB" in out
    assert re.search(r"largest micro-batch that fits: 8\b", out) and "plan: micro 8 × accumulation 1 × world 1 = 8" in out


@pytest.mark.parametrize("argv, meant", [(["--max_steps=5"], "max_steps=5"), (["--max_steps", "5"], "max_steps=5"),
                                         (["--lora.r=8", "--max_steps=3"], "lora.r=8 max_steps=3")])
def test_a_recipe_key_given_as_a_flag_is_answered_with_the_override_it_meant(argv, meant, capsys):
    """Issue 59, item 4: `hf-accum train lora_sft --max_steps=5` said only "unrecognized arguments"."""
    assert main(["train", "lora_sft", *argv]) == 2
    line = error_line(capsys)
    assert line.startswith(f"hf-accum train: unrecognized arguments: {' '.join(argv)}; recipe keys are key=value "
                           f"without dashes: {meant} (see ")
    assert main(["train", "lora_sft", "--bogus"]) == 2  # a flag with no value is not taken for a key
    assert "recipe keys" not in error_line(capsys)


def test_train_help_keeps_a_hyphenated_recipe_folder_whole(monkeypatch, capsys):
    """An installed wheel's recipe folder (.../site-packages/hf_accum/recipes/yaml) was wrapped at the hyphen of
    site-packages in `hf-accum train --help`: copied, the path did not exist (ci/installed_wheel.sh caught it)."""
    import pathlib

    from hf_accum.cli import main
    from hf_accum.recipes import files

    folder = pathlib.Path("/a-long-folder-name/venv/lib/python3.11/site-packages/hf_accum/recipes/yaml")
    monkeypatch.setattr(files, "recipe_dirs", lambda: [folder])
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    helped = capsys.readouterr().out
    assert str(folder) in [word.rstrip(").") for word in helped.split()]
