"""Ours, the fallback that runs everywhere (any device, dtype and torch >= 2.6): row chunks of
``F.linear -> float() -> cross_entropy`` under activation checkpointing. Each chunk is the unfused path's own
numerics (logits in the model's dtype, cross-entropy in float32, as transformers' `ForCausalLMLoss`), and its logits
are rebuilt in the backward, so one chunk's logits live at a time.

Measured (benchmarks/bench_fused_chunks.py, H200, ~1B Llama, bf16, micro 4 x 2048, vocab 128k): 128 rows per chunk
took 1.35x the unfused step, 1024 rows 1.09x (peak 0.70x vs 0.68x). On the CPU 128-1024 rows are as fast as the
unfused loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .base import IGNORE_INDEX, Memory

NAME = "chunked"
COUNTED_BY_OPS = True
PACKAGE = None
SETTINGS = ("label_smoothing",)

# Logits per chunk. CPU: 2**24 (64 MiB in float32). A GPU wants larger matrix products (see the module docstring).
CPU_LOGITS_PER_CHUNK = 1 << 24
ACCELERATOR_LOGITS_PER_CHUNK = 1 << 27


def chunk_rows(vocab: int, logits: int = CPU_LOGITS_PER_CHUNK) -> int:
    """Rows per chunk: about ``logits`` logits per chunk, a power of two in [64, 1024] -- on the CPU 512 rows at
    vocab 32k and 128 at 128k; on a GPU 1024 at both."""
    rows = max(1, logits // max(1, vocab))
    return max(64, min(1024, 1 << (rows.bit_length() - 1)))


def rows_for(device_type: str, vocab: int) -> int:
    return chunk_rows(vocab, CPU_LOGITS_PER_CHUNK if device_type == "cpu" else ACCELERATOR_LOGITS_PER_CHUNK)


def unavailable(device_type: str, dtype: torch.dtype, autocast: bool = False) -> str | None:
    return None


def _chunk_sum(hidden, weight, bias, targets, label_smoothing=0.0):
    logits = F.linear(hidden, weight, bias)
    # As ForCausalLMLoss: logits in the model's dtype, CE in float32 -- but never below the model's dtype (its
    # .float() would round float64 logits to float32).
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(logits, targets, reduction="sum", ignore_index=IGNORE_INDEX,
                           label_smoothing=label_smoothing)


def loss_sum(hidden, weight, bias, targets, *, label_smoothing: float = 0.0, rows: int | None = None):
    rows = rows or rows_for(hidden.device.type, weight.shape[0])
    total = None
    for start in range(0, hidden.shape[0], rows):
        part = checkpoint(_chunk_sum, hidden[start:start + rows], weight, bias, targets[start:start + rows],
                          label_smoothing, use_reentrant=False)
        total = part if total is None else total + part
    return total


def memory(rows: int, hidden: int, vocab: int, itemsize: int, device_type: str = "cpu",
           weight_grad: bool = True) -> Memory:
    """Nothing held between the passes (the checkpoint keeps views of its inputs). Per chunk of ``c`` rows the
    forward holds the logits in float32 (and in the model's dtype below float32) and their log-softmax; the backward
    rebuilds them and adds their gradient, and with several chunks one chunk's weight gradient is alive beside them.
    Measured on the CPU (vocab 32000, hidden 128, float32, 255 / 1024 rows): forward 62.4 / 125.5 MiB, backward
    93.4 / 203.6 MiB; this model 62.3 / 125.0 and 93.4 / 203.1. (The estimate counts its operators instead.)"""
    c = min(rows, rows_for(device_type, vocab))
    wide = max(itemsize, 4)
    narrow = c * vocab * itemsize if itemsize < 4 else 0
    forward = 2 * c * vocab * wide + narrow
    backward = 3 * c * vocab * wide + narrow + (vocab * hidden * itemsize if rows > c and weight_grad else 0)
    return Memory(held=0, forward=forward, backward=backward)
