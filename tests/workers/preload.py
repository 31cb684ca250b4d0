"""Imported once by the server every launched rank is forked from (`tests.launch`): what every worker imports,
so that a rank starts in milliseconds instead of ~10 s. Imports only: nothing here starts a thread or a process
group (a fork copies only the forking thread). Nothing more is preloaded, though a py-spy profile of the suite
(2026-11-29) found each of 51 ranks importing ~1.6 CPU-s more (hf_accum's Trainer modules, DeepSpeed): with those
imported first, the figures tests/probing/test_sharded_real.py measures moved (a LoRA rank's peak under FSDP2 up to
12.8% at micro-batch 1; DeepSpeed alone did it, and in the oldest env hf_accum's Trainer modules did), not yet
understood."""

import torch  # noqa: F401
import torch.distributed  # noqa: F401
import transformers  # noqa: F401
from transformers import Trainer, TrainingArguments  # noqa: F401
from transformers.models.gpt2 import modeling_gpt2  # noqa: F401
from transformers.models.llama import modeling_llama  # noqa: F401

import hf_accum  # noqa: F401
import hf_accum.trainer  # noqa: F401
import tests.exactness  # noqa: F401
