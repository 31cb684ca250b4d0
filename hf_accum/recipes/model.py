"""Step 2 of a recipe: the tokenizer and the model: the base (quantized when asked), then k-bit preparation,
checkpointing settings and LoRA."""

from __future__ import annotations

import logging

from ..config.settings import Settings
from ..levers.checkpointing import checkpointing_enabled
from ..probing.loading import hub_unreachable, load_model, not_loadable, require_bitsandbytes
from .config import Recipe, RecipeError, _quiet_deprecations

logger = logging.getLogger(__name__)


def build_tokenizer(recipe: Recipe):
    m = recipe.model
    if m.name == "tiny":
        from .. import tiny

        return tiny.build_tokenizer()
    unreachable = hub_unreachable("model.name", m.name)
    if unreachable is not None:
        raise RecipeError(str(unreachable))
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(m.name, revision=m.revision, trust_remote_code=m.trust_remote_code)
    except OSError as exc:
        raise RecipeError(str(not_loadable("model.name", m.name, exc))) from None
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise RecipeError(f"tokenizer of {m.name!r} has neither a pad nor an eos token; add a pad token to it")
        tok.pad_token = tok.eos_token  # padding is masked out of attention and labels, so any id works
    tok.padding_side = "right"
    return tok



def check_layers_requested(recipe: Recipe, args) -> None:
    """An explicit checkpoint_layers=K larger than the model's decoder layers is refused from the model's config,
    before the data is tokenized and the model built (the trainer refuses it again, from the built model, for
    configs this cannot read: several sub-models, encoder-decoders)."""
    want = args.checkpoint_layers
    if not isinstance(want, int) or isinstance(want, bool) or want <= 1:
        return
    m = recipe.model
    if m.name == "tiny":
        import inspect

        from .. import tiny

        layers = m.tiny.get("num_layers", inspect.signature(tiny.build_model).parameters["num_layers"].default)
    else:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(m.name, revision=m.revision, trust_remote_code=m.trust_remote_code)
        except (OSError, ValueError):
            return  # the model's own loading names the problem
        if config.is_encoder_decoder or config.sub_configs or not isinstance(
                getattr(config, "num_hidden_layers", None), int):
            return
        layers = config.num_hidden_layers
    if want > layers:
        raise RecipeError(f"training.checkpoint_layers={want}, but {m.name} has {layers} decoder layers: set "
                          f"checkpoint_layers to at most {layers}, 'auto', or gradient_checkpointing=true for every "
                          "layer")


def _torch_dtype(name: str | None):
    import torch

    if name in (None, "auto"):
        return name
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise RecipeError(f"model.dtype={name!r} is not a torch dtype; use float32, bfloat16, float16 or auto")
    return dtype


def build_model(recipe: Recipe, tokenizer, *, num_labels: int | None = None, use_cpu: bool = False):
    """The base model (quantized when `model.quantization` is set), not yet wrapped by peft."""
    import torch

    m = recipe.model
    try:
        if m.quantization is not None:
            require_bitsandbytes("model.quantization", "train LoRA on the unquantized base: `hf-accum train "
                                 "lora_sft`, or set model.quantization=null")
        return load_model(
            m.name, task="seq_cls" if m.task == "seq_cls" else "causal_lm", dtype=_torch_dtype(m.dtype), quantization=m.quantization,
            device="cpu" if use_cpu and m.quantization is not None or not torch.cuda.is_available() else None,
            num_labels=num_labels or m.num_labels or 2, tokenizer=tokenizer, tiny=m.tiny, label="model.name",
            revision=m.revision, trust_remote_code=m.trust_remote_code or None,
            attn_implementation=m.attn_implementation,
        )
    except RecipeError:
        raise
    except ValueError as exc:
        raise RecipeError(str(exc)) from None


def configure_checkpointing_for_lora(args) -> bool:
    """With checkpointing on, make it the LoRA-safe kind: non-reentrant unless the recipe says otherwise.

    Reentrant checkpointing computes no parameter gradient inside a segment whose inputs do not require grad,
    and with a frozen base they do not, so the adapters would silently not train; non-reentrant has no such
    condition. `enable_input_require_grads()` (done by :func:`add_lora`) covers a recipe that insists on reentrant.
    """
    if not checkpointing_enabled(args):
        return False
    kwargs = Settings(args).activation_checkpointing_kwargs or args.gradient_checkpointing_kwargs or {}
    if "use_reentrant" not in kwargs:
        kwargs["use_reentrant"] = False
        logger.info("hf_accum: gradient checkpointing with LoRA: use_reentrant=False")
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        if hasattr(args, name):
            setattr(args, name, kwargs)  # 5.23 mirrors the old name onto the new; keep both pointing at one dict
    return True


def add_lora(model, recipe: Recipe, args):
    """`loading.add_lora` (shared with `hf-accum probe`) with the recipe's LoRA and k-bit settings; a
    `lora.target_modules` name that matches no layer of this model is a RecipeError listing the layers there are."""
    from ..probing.loading import add_lora as shared_add_lora
    from ..trainer.checks.lora_targets import linear_names, unmatched_target

    checkpointing = configure_checkpointing_for_lora(args)
    given = recipe.lora.get("target_modules")
    with _quiet_deprecations():
        try:
            wrapped = shared_add_lora(
                model, recipe.lora_config(), quantized=recipe.model.quantization is not None,
                kbit_preparation=recipe.model.kbit_preparation, checkpointing=checkpointing,
            )
        except ValueError as exc:
            if "target_modules" not in recipe.lora and "not found in the base model" not in str(exc):
                raise
            raise RecipeError(
                f"lora.target_modules={given!r} does not fit {recipe.model.name!r}: "
                f"{str(exc).splitlines()[0]} Its layers that LoRA can adapt: {', '.join(linear_names(model))}; "
                "or lora.target_modules=all-linear"
            ) from None
    problem = unmatched_target(wrapped)  # some names matched, others not: peft trains the matched ones silently
    if problem:
        raise RecipeError(f"lora.target_modules={given!r} does not fit {recipe.model.name!r}: {problem}")
    return wrapped
