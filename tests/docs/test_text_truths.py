"""Small lies in the text (issue 27, point 8): `train --help` names every recipe, the DPO data line reports a mean
not above the longest and says pairs where it means pairs, a mistyped recipe key is reported without importing torch,
transformers, peft or TRL, and `hf-accum probe RECIPE` without output_dir says once, truthfully, that the plan was not
stored."""

import os
import re
import subprocess
import sys

import pytest

from hf_accum import recipes
from hf_accum.cli import main
from hf_accum.recipes.config import valid_keys
from hf_accum.recipes.files import available_recipes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_help_names_every_recipe(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    listed = re.search(r"Recipes: ([\w, ]+) \(the YAML files in ", text).group(1).split(", ")
    assert listed == available_recipes() and "lora_dpo" in listed


def test_the_dpo_lines_report_sequences_and_pairs(tmp_path):
    said = []
    recipes.run_recipe("lora_dpo", ["num_examples=48", "max_steps=1", "disable_tqdm=true",
                                    f"output_dir={tmp_path / 'out'}"], say=said.append)
    data = next(line for line in said if line.startswith("data "))
    match = re.fullmatch(r"data tiny: 48 pairs, ([\d.]+) tokens per sequence on average \(two per pair: prompt \+ "
                         r"chosen, prompt \+ rejected\), longest sequence (\d+)", data)
    assert match, data
    assert float(match.group(1)) <= int(match.group(2))
    # the plan is the tuner's one line (logged); the recipe prints no second plan line saying "samples" for pairs
    assert not any(line.startswith(("plan: ", "hf_accum plan: ")) for line in said), said
    assert not any("samples per" in line for line in said), said


def test_a_mistyped_key_is_reported_without_heavy_imports(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    valid_keys("causal_lm")  # what the first run after an install does: read the keys from the classes, once
    assert len(os.listdir(tmp_path / "hf_accum")) == 1
    script = ("import sys; from hf_accum.cli import main; rc = main(['train', 'lora_sft', 'lora.rank=3']); "
              "print(rc, [m for m in ('torch', 'transformers', 'peft', 'trl') if m in sys.modules])")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert run.stdout.strip() == "2 []", run.stdout + run.stderr
    assert run.stderr.startswith("hf-accum train: unknown key 'lora.rank'. Did you mean lora.r"), run.stderr


def test_a_stale_key_cache_is_not_used(tmp_path, monkeypatch):
    from hf_accum.recipes import config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = config._keys_cache_file()
    monkeypatch.setattr(config, "_KEY_SOURCES", (*config._KEY_SOURCES, "cli.py"))  # another source: another file
    assert config._keys_cache_file() != first


def test_probe_without_output_dir_says_once_that_nothing_was_stored(tmp_path, capsys, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["probe", "lora_classification"]) == 0
    captured = capsys.readouterr()
    lines = (captured.out + captured.err + caplog.text).splitlines()
    about_the_file = [line for line in lines if re.search(r"written to|stored|plan file", line)]
    assert about_the_file == ["plan not stored: add output_dir=DIR to store it where `hf-accum train` reuses it"]
    assert os.listdir(tmp_path) == []
