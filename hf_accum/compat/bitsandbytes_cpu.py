"""bitsandbytes' CPU inference layout for 4-bit weights, kept out of every model hf_accum trains.

bitsandbytes (checked on 0.50.2) has `Linear4bit.forward` convert its weight **in place and for good** into a
CPU "packed" layout the first time it runs on a CPU input in eval mode without grad, where the CPU has AVX512-BF16
(the layer's `support_avx512bf16_for_cpu`, set from `has_avx512bf16()` at construction; the converted quant state
carries `packing_format_for_cpu=True`). From then on every forward, training ones included, goes through
`F.gemv_4bit`, which has no autograd kernel: the gradient into the layer's input is dropped (LoRA adapters below it
get wrong gradients, silently), its block scales are rounded to bfloat16, and with a bias `result += bias` fails
on a leaf that requires grad. Any eval-mode forward does it: the fused loss's verification forward, evaluation,
the eval-batch measurement. docs/bitsandbytes-cpu-packing.md is the report for bitsandbytes.

`keep_unpacked(*models)` turns the per-layer flag off on every `Linear4bit`, so that conversion never happens (eval
forwards then take the same dequantizing path as training ones); a layer already converted before hf_accum saw it
is converted back with bitsandbytes' own inverse (what its `state_dict` and `.cuda()` do). Where bitsandbytes
packs but this flag is gone (it changed the mechanism) training is refused: nothing else could keep it off.
Pinned by tests/compat/test_bitsandbytes_cpu.py.
"""

from __future__ import annotations

import logging
import sys

import torch

logger = logging.getLogger("hf_accum.trainer")

FLAG = "support_avx512bf16_for_cpu"  # Linear4bit's instance attribute: forward may pack where it is true
PACKED = "packing_format_for_cpu"  # set on the weight's QuantState once packed


def _bitsandbytes():
    # Nothing can hold a bitsandbytes layer unless bitsandbytes is imported: never import it for a model without.
    return sys.modules.get("bitsandbytes")


def is_packed(layer) -> bool:
    """Whether a `Linear4bit`'s weight is in the CPU inference layout."""
    return bool(getattr(layer.weight.quant_state, PACKED, False))


def four_bit_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    bnb = _bitsandbytes()
    if bnb is None:
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]


def keep_unpacked(*models: torch.nn.Module) -> int:
    """Keep every `Linear4bit` of ``models`` out of the CPU inference layout from now on (see the module's
    docstring). Returns how many layers were already packed and have been converted back. Idempotent and cheap."""
    bnb = _bitsandbytes()
    if bnb is None:
        return 0
    converted = []
    seen: set[int] = set()
    for model in models:
        for name, layer in four_bit_layers(model):
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            if not hasattr(layer, FLAG) and hasattr(bnb.functional, "_convert_weight_packed_for_cpu"):
                raise RuntimeError(
                    f"bitsandbytes {bnb.__version__}: its Linear4bit ({name}) no longer has `{FLAG}`, the flag "
                    "hf_accum turns off so that an eval-mode forward on CPU cannot switch the layer to its "
                    "gradient-dropping inference layout; train this 4-bit model with the bitsandbytes 0.50 series "
                    "or on a GPU"
                )
            setattr(layer, FLAG, False)
            if is_packed(layer):
                layer.weight.data, layer.weight.quant_state = bnb.functional._convert_weight_packed_for_cpu_inverse(
                    layer.weight.data, layer.weight.quant_state
                )
                converted.append(name)
    if converted:
        logger.warning(
            "hf_accum: %d 4-bit layer(s) (%s%s) were in bitsandbytes' CPU inference layout (an eval-mode forward ran "
            "before hf_accum got the model), in which training gradients are wrong; converted back with "
            "bitsandbytes' own inverse (as its save does): their block scales stay rounded to bfloat16",
            len(converted), ", ".join(converted[:3]), ", ..." if len(converted) > 3 else "",
        )
    return len(converted)


def trainer_modules(trainer) -> list[torch.nn.Module]:
    """Every model a trainer holds (the model, its wrappers, TRL's reference model, ...)."""
    return [value for value in vars(trainer).values() if isinstance(value, torch.nn.Module)]
