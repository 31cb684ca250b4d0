"""Imported once by the server every launched rank is forked from (`tests.launch`): what every worker imports,
so that a rank starts in milliseconds instead of ~10 s. Imports only: nothing here starts a thread or a process
group (a fork copies only the forking thread)."""

import torch  # noqa: F401
import torch.distributed  # noqa: F401
import transformers  # noqa: F401
from transformers import Trainer, TrainingArguments  # noqa: F401
from transformers.models.gpt2 import modeling_gpt2  # noqa: F401
from transformers.models.llama import modeling_llama  # noqa: F401

import hf_accum  # noqa: F401
import hf_accum.trainer  # noqa: F401
import tests.exactness  # noqa: F401
