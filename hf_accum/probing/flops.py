"""Model FLOPs of a training step and the device's bf16 peak: what MFU (model FLOPs utilization) is made of.

MFU = (model FLOPs per token x tokens per second) / the device's dense bf16 peak. Model FLOPs count what the model
needs, not what a run spends: recomputation under gradient checkpointing is not counted (PaLM's definition).
"""

from __future__ import annotations

# Dense (no structured sparsity) bf16 tensor-core peaks from the vendors' datasheets, TFLOP/s, by a fragment of
# the name torch.cuda.get_device_name() reports. The longest matching fragment wins ("H100 NVL" before "H100").
BF16_PEAK_TFLOPS: dict[str, float] = {
    "H100": 989.4,  # SXM5 ("NVIDIA H100 80GB HBM3")
    "H100 PCIE": 756.0,
    "H100 NVL": 835.0,
    "H200": 989.4,
    "H200 NVL": 835.0,
    "GH200": 989.4,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.1,
    "L4": 121.0,
}


def bf16_peak_flops(device_name: str | None) -> float | None:
    """The dense bf16 peak of the named device in FLOP/s, or None when the table does not know it (a CPU)."""
    if not device_name:
        return None
    name = device_name.upper().replace("-", " ")
    known = [key for key in BF16_PEAK_TFLOPS if key in name]
    return BF16_PEAK_TFLOPS[max(known, key=len)] * 1e12 if known else None


def linear_parameters(model) -> int:
    """Weights that take part in matrix products (every ``nn.Linear``, the LM head included; embedding lookups
    are no matrix product)."""
    import torch

    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight
            # a 4-bit (bitsandbytes) weight is stored packed: its logical size is in_features x out_features
            total += module.in_features * module.out_features if hasattr(weight, "quant_state") else weight.numel()
    return total


def training_flops_per_token(model, seq_len: int) -> float:
    """Model FLOPs of forward + backward per token at ``seq_len``: 6 x matmul weights, plus attention's scores
    and weighted sum (12 x layers x hidden x seq_len; the full square, as PaLM and nanoGPT count it)."""
    config = getattr(model, "config", None)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    return 6.0 * linear_parameters(model) + 12.0 * layers * hidden * seq_len


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilization in [0, 1]; None without a known peak."""
    if not peak_flops or tokens_per_second <= 0:
        return None
    return tokens_per_second * flops_per_token / peak_flops
