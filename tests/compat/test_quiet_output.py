"""Output nobody asked for (issue 27, point 7): a recipe run prints no message that no user can act on (DeepSpeed's
"Setting accelerator to CPU", peft's save_embedding_layers note, the renamed-checkpointing FutureWarnings TRL's DPO
trips, bitsandbytes' optional-kernel download), each dropped by its exact text, while every other warning of the
same libraries, loggers and categories still shows."""

import logging
import os
import subprocess
import sys
import warnings

import pytest

import hf_accum  # noqa: F401  (installs the filters)
from hf_accum.compat._quiet import DROPPED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOISE = ["Setting accelerator to CPU", "save_embedding_layers", "gradient_checkpointing` is deprecated",
         "gradient_checkpointing_enable` is deprecated", "gradient_checkpointing_disable` is deprecated",
         "gemm_4bit_forward", "pip install kernels"]


def test_a_recipe_run_prints_no_noise_and_still_warns(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "hf_accum.cli", "train", "lora_dpo", "max_steps=1", "disable_tqdm=true",
         "per_device_train_batch_size=4", f"output_dir={tmp_path / 'out'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert [n for n in NOISE if n in output] == [], output
    # a genuine warning (a setting the plan replaces) still shows
    assert "per_device_train_batch_size=4 is not used" in output


@pytest.mark.parametrize("name", list(DROPPED))
def test_only_the_exact_message_is_dropped(name, caplog):
    logger = logging.getLogger(name)
    with caplog.at_level(logging.WARNING, logger=name):
        logger.warning(DROPPED[name] + " %s", "(details)")
        logger.warning("another warning of the same logger")
    assert [r.getMessage() for r in caplog.records if r.name == name] == ["another warning of the same logger"]


def test_the_recipe_scope_lets_other_warnings_through():
    from hf_accum.recipes.run import _PEFT_SAVES_EMBEDDINGS, _quiet

    sent = [(_PEFT_SAVES_EMBEDDINGS, UserWarning),
            ("`gradient_checkpointing_enable` is deprecated and will be removed in v6.", FutureWarning),
            ("Setting `save_embedding_layers` to `False` for another reason.", UserWarning),
            ("`some_other_api` is deprecated", FutureWarning)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with _quiet():
            for message, category in sent:
                warnings.warn(message, category, stacklevel=1)
    assert [str(w.message) for w in seen] == ["Setting `save_embedding_layers` to `False` for another reason.",
                                              "`some_other_api` is deprecated"]


# A CPU with AVX512-BF16 is simulated: bitsandbytes then tries its optional Hub kernel on import and logs the line.
_AVX512_BF16 = """
import importlib.abc, importlib.machinery, sys

class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes.functional":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.has_avx512bf16 = lambda: True
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Patch())
"""


@pytest.mark.parametrize("imports", [
    "import hf_accum; import peft",
    "import transformers; import hf_accum; from transformers import Trainer",
    "import transformers; import hf_accum; import peft",
    None,  # the control: without hf_accum the line is there, so the simulation reaches it
])
def test_bitsandbytes_kernel_line_is_dropped_whenever_hf_accum_comes_before_bitsandbytes(imports):
    code = _AVX512_BF16 + (imports or "import peft")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("pip install kernels" in run.stderr) is (imports is None), run.stderr[-3000:]
