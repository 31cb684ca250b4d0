"""Every name a LoRA `target_modules` list gives must adapt a module. peft refuses a list of which no name matches,
but trains the others without a word when only some match (`[q_proj, nonexistent_mod]` trains q_proj alone): a
mistyped name silently shrinks the adapter. Checked on the wrapped model (what peft built), so a `peft_config` a
TRL trainer wraps with and a PEFT model built by the caller are judged alike."""

from __future__ import annotations

# peft's own submodules inside an adapted layer, and the wrapper's copies: not the model's layers
_PEFT_PARTS = {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector", "modules_to_save",
               "lora_dropout"}


def unmatched_target(model) -> str | None:
    """A one-line refusal when an adapter of the PEFT model ``model`` lists a `target_modules` name that adapted
    no module (regex strings and 'all-linear' aside: peft resolves and checks those); None otherwise."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted = [name for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]
    for adapter, config in configs.items():
        targets = getattr(config, "target_modules", None)
        if not isinstance(targets, (list, set, tuple, frozenset)):
            continue
        missing = sorted(t for t in targets if not any(n == t or n.endswith("." + t) for n in adapted))
        if missing:
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            which = f" (adapter {adapter!r})" if len(configs) > 1 else ""
            return (
                f"LoRA target_modules{which} lists {', '.join(map(repr, missing))}, which matches no module of "
                f"{type(base).__name__}: peft would adapt only the other names, without a word. Its linear "
                f"layers: {', '.join(linear_names(model))}. Fix or remove the name, or use target_modules='all-linear'."
            )
    return None


def linear_names(model) -> list[str]:
    """Names (last component) of the layers of ``model`` LoRA can adapt: linear, embedding and 1-D convolution
    layers, quantized linears included; an adapted layer counts under its own name."""
    import torch

    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d)
    names = set()
    for name, module in model.named_modules():
        if not name or not (isinstance(module, kinds) or type(module).__name__ in ("Linear4bit", "Linear8bitLt", "Conv1D")):
            continue
        parts = name.split(".")
        if _PEFT_PARTS & set(parts):
            continue
        while parts[-1] in ("base_layer", "original_module"):
            parts.pop()
        names.add(parts[-1])
    return sorted(names)
