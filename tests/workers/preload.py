"""Imported once by the server every launched rank is forked from (`tests.launch`): what every worker imports,
so that a rank starts in milliseconds instead of ~10 s. Imports only: nothing here starts a thread or a process
group (a fork copies only the forking thread). The suite's profile (py-spy over a README run, 2026-11-29) found
each rank still importing ~1.6 CPU-s: DeepSpeed (accelerate's `extract_model_from_parallel` imports it when it is
installed, and its op builder setuptools), hf_accum's Trainer modules (`hf_accum.trainer` loads them lazily) and the
test modules the workers share; 51 ranks paid it each."""

import importlib.util

import setuptools  # noqa: F401
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.nn.modules.linear_cross_entropy  # noqa: F401
import transformers  # noqa: F401
from transformers import Trainer, TrainingArguments  # noqa: F401
from transformers.models.gpt2 import modeling_gpt2  # noqa: F401
from transformers.models.llama import modeling_llama  # noqa: F401

import hf_accum  # noqa: F401
import hf_accum.probing.probe  # noqa: F401
import tests.exactness  # noqa: F401
import tests.trainer.test_nonfinite  # noqa: F401
import tests.trainer.test_oom_recovery  # noqa: F401
from hf_accum.trainer.mixin import AccumTrainer  # noqa: F401

if importlib.util.find_spec("deepspeed") is not None:  # a dev extra: the oldest env may lack it
    import deepspeed  # noqa: F401
