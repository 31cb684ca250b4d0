"""The `model` and `data` sections of a recipe: their keys, defaults and what each means (the docstring under each
field is its documentation). The `lora` and `training` sections are peft's and the trainer's own configs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelSection:
    name: str = "tiny"
    """"tiny" (a small Llama built from config, offline), a hub id, or a local directory."""
    task: str = "causal_lm"
    """"causal_lm" (AutoModelForCausalLM, SFT), "dpo" (AutoModelForCausalLM, preference pairs through
    `AccumDPOTrainer`), "grpo" (AutoModelForCausalLM, prompts and their answers through `AccumGRPOTrainer`, rewarded by
    `hf_accum.recipes.rewards`) or "seq_cls" (AutoModelForSequenceClassification)."""
    dtype: str | None = None
    """dtype of the weights that are not quantized: float32 (None), bfloat16, float16, or "auto" (the checkpoint's)."""
    num_labels: int | None = None
    """seq_cls: number of classes; None: from the data."""
    quantization: dict[str, Any] | None = None
    """`transformers.BitsAndBytesConfig` keyword arguments (QLoRA: load_in_4bit, bnb_4bit_quant_type nf4, ...)."""
    kbit_preparation: str = "light"
    """Quantized bases only. "light": freeze, input grads, non-reentrant checkpointing, no upcast (the default);
    "peft": `peft.prepare_model_for_kbit_training`, which also upcasts every non-quantized weight to float32."""
    revision: str | None = None
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    tiny: dict[str, Any] = field(default_factory=dict)
    """name=tiny: keyword arguments of `hf_accum.tiny.build_model` (hidden_size, num_layers, num_heads, seed)."""
    cpu_threads: int | None = None
    """On CPU: torch.set_num_threads for the run (restored after); None: torch's default (one per core). A tiny
    model's matmuls are too small to split: 1 thread is fastest, and on shared cores 2 were 10-100x slower."""


@dataclass
class DataSection:
    dataset: str = "tiny"
    """"tiny" (generated tasks, offline), a hub id, a dataset directory, or a local .json/.jsonl/.csv/.parquet file."""
    subset: str | None = None
    """Hub dataset configuration name."""
    split: str = "train"
    num_examples: int | None = None
    """tiny: how many examples to generate (default 2000); otherwise: use the first N rows (None: all)."""
    eval_examples: int = 0
    """Rows held out for evaluation: the last N of them (0: none). The run evaluates them after training (and every
    training.eval_steps with training.eval_strategy=steps); eval_loss is the exact mean over every target token (a
    pair for dpo, an example for seq_cls), whatever the eval batch."""
    max_length: int = 512
    """seq_cls: tokens per example after truncation (the end is cut). causal_lm and dpo: TRL truncates, so the
    length is `training.max_length`; setting data.max_length there is an error that says so."""
    seed: int = 0
    """Seed of the generated tiny data."""
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    """SFT rows are {prompt_field, response_field} pairs, or chat `messages` whose last turn (assistant) is the target;
    both become TRL prompt-completion rows (completion-only loss), in chat form where the tokenizer has a template."""
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    """dpo rows are {prompt_field, chosen_field, rejected_field}: strings, or chat messages (TRL's formats)."""
    answer_field: str = "answer"
    """grpo rows are {prompt_field, answer_field}: the prompt (a string, or chat messages) and the answer the reward
    checks a completion against."""
    text_field: str = "text"
    label_field: str = "label"
    """seq_cls rows are {text_field, label_field}; string labels are mapped to ids in sorted order."""
