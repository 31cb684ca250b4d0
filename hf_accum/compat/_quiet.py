"""Messages other libraries print on every run that no hf_accum user can act on, dropped by their exact text at the
logger that emits them (never a logger, level or category as a whole: every other message still shows). Installed
when `hf_accum` is imported; nothing here imports those libraries.

- bitsandbytes, on import on a CPU with AVX512-BF16: "Failed to load CPU gemm_4bit_forward from kernels-community
  ... pip install kernels". It tries to download an optional kernel from the Hub and falls back to its own, which
  is what runs either way (offline, the download can only fail); transformers imports bitsandbytes whenever it is
  installed, so every `import transformers.Trainer` printed it. It is printed while bitsandbytes is imported, so it
  is dropped only where `import hf_accum` comes first (`import peft` or `from transformers import Trainer` before it
  has printed it before any code here runs; a plain `import transformers` does not import bitsandbytes).
- DeepSpeed, when accelerate or transformers first asks it for its accelerator on a machine where torch sees no GPU:
  "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." It is printed
  whether or not DeepSpeed is used; a run on CPU already says it runs on CPU (the plan line names the device).

peft's `save_embedding_layers` warning and the renamed-checkpointing FutureWarnings TRL's DPO trips are scoped to the
recipe runs that cause them (`recipes/run.py`), where the recipe's own choices make them say nothing.
"""

from __future__ import annotations

import logging

DROPPED = {
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
    "DeepSpeed": "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
}


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.text)


def install() -> None:
    for name, text in DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.text == text for f in logger.filters):
            logger.addFilter(_DropMessage(text))
