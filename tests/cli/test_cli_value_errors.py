"""Issue 34 item 6: a wrong value of a recipe key answers as fast as a mistyped key: one line, exit 2, before torch,
transformers, peft, TRL or datasets are imported (the rules of recipes/rules.py, the types cached with the keys).
The process is the real console script (`python -m hf_accum.cli`); `-X importtime` lists every module it imported."""

import os
import subprocess
import sys

import pytest

from hf_accum.config.paths import can_create_in
from hf_accum.recipes import config
from hf_accum.recipes.config import TASKS, field_specs, valid_keys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAVY = ("torch", "transformers", "peft", "trl", "datasets", "bitsandbytes")


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """What the first run after an install does once: read the keys and their types from the classes."""
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    try:
        for task in TASKS:
            valid_keys(task)
            field_specs(task)
        config._tiny_keys(), config._bnb_keys()  # the keys of model.tiny and model.quantization mappings
    finally:
        if old is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = old
    return str(cache)


CASES = [
    (["learning_rate=-1"], "hf-accum train: training.learning_rate=-1 is negative: set a positive learning_rate"),
    (["learning_rate=.nan"], "training.learning_rate=nan is not a finite number"),
    (["learning_rate=abc"], "training.learning_rate='abc' is a string, but training.learning_rate takes a number"),
    (["num_train_epochs=0", "max_steps=-1"], "training.num_train_epochs=0 with max_steps=-1 trains nothing"),
    (["max_steps=0"], "training: max_steps=0 is not a number of steps"),
    (["checkpoint_layers=abc"], "training.checkpoint_layers='abc' must be 'auto' or an integer >= 0"),
    (["checkpoint_layers=-1"], "training.checkpoint_layers=-1 must be 'auto' or an integer >= 0"),
    (["target_batch_size=0"], "training.target_batch_size=0 must be a positive integer"),
    (["target_batch_size=abc"], "training.target_batch_size='abc' is a string, but training.target_batch_size takes "
                                "an integer or null"),
    (["memory_budget=1.5"], "training.memory_budget=1.5 must be a fraction in (0, 1]"),
    (["loss_normalization=mean"], "training.loss_normalization='mean' is not one of ['tokens', 'samples', 'model']"),
    (["save_strategy=sometimes"], "training.save_strategy takes one of 'no', 'steps', 'epoch', 'best'"),
    (["lora.r=0"], "lora.r=0 must be a positive integer"),
    # issue 59, items 1 and 6: max_length=-3 trained (as "drop the last 3 tokens"); lora_dropout=2 was refused after
    # 10 s of model building, blaming lora.target_modules
    (["training.max_length=-3"], "training.max_length=-3 must be a positive number of tokens (or null: no limit)"),
    (["lora.lora_dropout=2"], "lora.lora_dropout=2 must be a probability in [0, 1)"),
    (["beta=0.1"], "unknown key 'beta'. beta is a training key of the DPO and GRPO recipes (model.task=dpo/grpo: "
                   "lora_dpo, lora_grpo), not of this causal_lm recipe's trainer config"),
    (["model=./no_such_model"], "model.name='./no_such_model' is a path, but there is no such directory"),
    (["save_steps=-5"], "training.save_steps=-5 is negative: give a number of optimizer steps"),
    (["save_total_limit=-1"], "training.save_total_limit=-1 is negative: give how many checkpoints to keep"),
    (["model.dtype=float33"], "model.dtype='float33' is not a torch dtype"),
    (["model.task=regression"], "model.task='regression' must be one of ['causal_lm', 'seq_cls', 'dpo', 'grpo']"),
    (["data.eval_examples=-1"], "data.eval_examples=-1 must be a whole number of rows"),
    (["eval_strategy=steps"], "training.eval_strategy=steps evaluates during training, but no rows are held out"),
    (["model.task=dpo", "beta=abc"], "training.beta='abc' is a string, but training.beta takes a number"),
    (["output_dir=/proc/nope"], "training.output_dir='/proc/nope' cannot be written"),
    (["probe", "learning_rate=-1"], "hf-accum probe: training.learning_rate=-1 is negative"),
    (["probe", "output_dir=/proc/nope"], "hf-accum probe: training.output_dir='/proc/nope' cannot be written"),
]


@pytest.mark.parametrize("overrides,message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_wrong_value_is_one_line_exit_2_before_any_heavy_import(overrides, message, warm_cache, tmp_path):
    if "output_dir=/proc/nope" in overrides and can_create_in("/proc"):  # pragma: no cover - not Linux
        pytest.skip("/proc is writable here")
    env = {**os.environ, "XDG_CACHE_HOME": warm_cache, "PYTHONPATH": ROOT}
    command = ["probe"] if overrides[0] == "probe" else ["train"]  # `hf-accum probe RECIPE` loads it as train does
    overrides = overrides[1:] if overrides[0] == "probe" else overrides
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "hf_accum.cli", *command, "lora_sft", *overrides],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    timing = [line for line in run.stderr.splitlines() if line.startswith("import time:")]
    said = [line for line in run.stderr.splitlines() if not line.startswith("import time:")]
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in timing}
    assert timing and "hf_accum" in imported  # -X importtime did list the imports
    assert run.returncode == 2 and run.stdout == ""
    assert len(said) == 1 and message in said[0], run.stderr
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
    assert os.listdir(tmp_path) == []  # nothing written (no output_dir created)
