"""Imported once by the server every launched rank is forked from (`tests.launch`): what every worker imports,
so that a rank starts in milliseconds instead of ~10 s. Imports only: nothing here starts a thread or a process
group (a fork copies only the forking thread). The suite's profile (py-spy over a README run, 2026-11-29) found
each of 51 ranks still importing ~1.6 CPU-s, among it hf_accum's Trainer modules (`hf_accum.trainer` loads them
lazily) and setuptools (DeepSpeed's op builder imports it). Not preloaded, because the figures the workers measure
moved with them: DeepSpeed (imported first, a LoRA rank's peak under FSDP2 measured 12.8% higher at micro-batch 1
in tests/probing/test_sharded_real.py, not yet understood) and the test modules the workers import."""

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
from hf_accum.trainer.mixin import AccumTrainer  # noqa: F401
