"""Quantized bases on paper: bitsandbytes' NF4 and LLM.int8 linear layers as stand-ins that run on fake tensors.

bitsandbytes' own parameter classes (`Params4bit`, `Int8Params`) are tensor subclasses that cannot hold a fake
tensor, so `quantize(model, quantization)` swaps every linear layer transformers would quantize (its own rule:
`should_convert_module` over `get_keys_to_not_convert`) for a stand-in that subclasses bitsandbytes' layer (peft's
`get_peft_model` then dispatches its own bitsandbytes LoRA layers on top, as on a loaded model) and holds what
bitsandbytes stores:

- NF4 (`bnb_4bit_*`, as `BitsAndBytesConfig` writes them): the weight packed two to a byte, ``(out*in + 1) // 2``
  uint8; one absmax per 64-block, float32, or with double quantization uint8 plus its own float32 absmax per 256 of
  them, the 256-entry code and the offset (`quantize_4bit(compress_statistics=True)`);
- int8: the int8 weight ``out x in`` and one float32 scale per row (`int8_vectorwise_quant`).

The steps are bitsandbytes' own where they are Python: the forward dequantizes the whole weight to the compute
dtype (`F.dequantize_4bit`, whose kernels bitsandbytes registers fake implementations for, so the buffer it returns
is counted) and multiplies; the backward dequantizes again for the input's gradient. That is what
`MatMul4Bit` / `gemm_4bit`'s default kernel (the one the CPU runs) allocate; int8 runs bitsandbytes' `MatMul8bitFp`
itself (the CPU's training path: it keeps the layer's input for the backward). tests/probing/test_estimate_quantized.py
checks one layer against the real bitsandbytes layer's measured peak, and whole models against the probe.
"""

from __future__ import annotations

from typing import Any

import torch

QUANTIZATIONS = ("nf4", "int8")
BLOCKSIZE = 64  # bitsandbytes' 4-bit default (BitsAndBytesConfig has no blocksize field)
NESTED_BLOCKSIZE = 256  # the double quantization's blocks of absmax values (quantize_4bit)


def settings(quantization: str | None, compute_dtype: torch.dtype = torch.bfloat16,
             double_quant: bool = True) -> dict[str, Any] | None:
    """The `BitsAndBytesConfig` keywords ``quantization`` stands for (None: none): NF4 as the QLoRA recipe loads
    it (double quantization, bf16 compute), or LLM.int8. A ValueError names the values for anything else."""
    if quantization is None:
        return None
    if quantization == "nf4":
        return {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": double_quant,
                "bnb_4bit_compute_dtype": compute_dtype}
    if quantization == "int8":
        return {"load_in_8bit": True}
    raise ValueError(f"quantization={quantization!r}: give one of None, {', '.join(map(repr, QUANTIZATIONS))}")


def _bnb():
    try:
        import bitsandbytes
    except ImportError as exc:
        raise ValueError(f"quantization needs bitsandbytes to model its layers ({exc}): pip install "
                         "bitsandbytes (the qlora extra)") from None
    return bitsandbytes


def _layers():
    """The stand-in classes (defined on first use: they subclass bitsandbytes' layers, imported only when asked)."""
    if _CLASSES:
        return _CLASSES
    bnb = _bnb()
    _CLASSES.update(nf4=_paper_linear4bit(bnb), int8=_paper_linear8bit(bnb))
    return _CLASSES


def _dequantized_4bit():
    from bitsandbytes import functional as F

    class Dequantized4bit(torch.autograd.Function):
        """`MatMul4Bit` with `gemm_4bit`'s default kernel inlined: the weight dequantized, multiplied, freed; the
        packed weight (stored anyway) is all the backward keeps."""

        @staticmethod
        def forward(ctx, a, packed, bias, state):
            ctx.state, ctx.packed = state, packed
            weight = F.dequantize_4bit(packed, state).to(a.dtype)
            return torch.nn.functional.linear(a, weight, bias)

        @staticmethod
        def backward(ctx, grad_output):
            grad_a = None
            if ctx.needs_input_grad[0]:
                grad_a = torch.matmul(grad_output, F.dequantize_4bit(ctx.packed, ctx.state).to(grad_output.dtype))
            grad_bias = grad_output.sum(0) if ctx.needs_input_grad[2] else None
            return grad_a, None, grad_bias, None

    return Dequantized4bit


def _paper_linear4bit(bnb):
    from bitsandbytes import functional as F

    dequantized_4bit = _dequantized_4bit()

    class PaperLinear4bit(bnb.nn.Linear4bit):
        """bitsandbytes' `Linear4bit` on paper (see the module's docstring)."""

        def __init__(self, linear: torch.nn.Linear, compute_dtype: torch.dtype, quant_type: str,
                     double_quant: bool) -> None:
            torch.nn.Module.__init__(self)
            self.in_features, self.out_features = linear.in_features, linear.out_features
            self.compute_dtype, self.compute_type_is_set = compute_dtype, True
            self.quant_type, self.double_quant = quant_type, double_quant
            self.support_avx512bf16_for_cpu = False  # never the CPU inference layout (compat/bitsandbytes_cpu)
            n = self.in_features * self.out_features
            blocks = -(-n // BLOCKSIZE)
            self.weight = torch.nn.Parameter(torch.empty((n + 1) // 2, 1, dtype=torch.uint8), requires_grad=False)
            # what peft's dispatcher reads off a `Params4bit` (the fake weight made later need not carry them)
            self.weight.compress_statistics, self.weight.quant_type = double_quant, quant_type
            self.weight.quant_state = None  # never packed for CPU inference (compat/bitsandbytes_cpu reads it)
            self.bias = (None if linear.bias is None else
                         torch.nn.Parameter(torch.empty_like(linear.bias), requires_grad=False))
            self.register_buffer("code", torch.empty(16, dtype=torch.float32))
            if double_quant:
                self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8))
                self.register_buffer("absmax2", torch.empty(-(-blocks // NESTED_BLOCKSIZE), dtype=torch.float32))
                self.register_buffer("code2", torch.empty(256, dtype=torch.float32))
                self.register_buffer("offset", torch.empty((), dtype=torch.float32))
            else:
                self.register_buffer("absmax", torch.empty(blocks, dtype=torch.float32))

        def paper_state(self):
            state2 = (F.QuantState(absmax=self.absmax2, code=self.code2, blocksize=NESTED_BLOCKSIZE,
                                   dtype=torch.float32) if self.double_quant else None)
            return F.QuantState(absmax=self.absmax, shape=torch.Size((self.out_features, self.in_features)),
                                code=self.code, blocksize=BLOCKSIZE, quant_type=self.quant_type,
                                dtype=self.compute_dtype, offset=self.offset if self.double_quant else None,
                                state2=state2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # Linear4bit.forward, on CPU training's path
            inp_dtype = x.dtype
            x = x.to(self.compute_dtype)
            bias = None if self.bias is None else self.bias.to(self.compute_dtype)
            return dequantized_4bit.apply(x, self.weight, bias, self.paper_state()).to(inp_dtype)

    return PaperLinear4bit


def _paper_linear8bit(bnb):
    from bitsandbytes.autograd._functions import MatMul8bitFp, MatmulLtState

    class PaperLinear8bitLt(bnb.nn.Linear8bitLt):
        """bitsandbytes' `Linear8bitLt` (``has_fp16_weights=False``) on paper: int8 weight, row scales, and
        bitsandbytes' own `MatMul8bitFp` (what `bnb.matmul` runs for training on CPU)."""

        def __init__(self, linear: torch.nn.Linear, threshold: float) -> None:
            torch.nn.Module.__init__(self)
            self.in_features, self.out_features = linear.in_features, linear.out_features
            self.weight = torch.nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=torch.int8),
                                             requires_grad=False)
            self.bias = (None if linear.bias is None else
                         torch.nn.Parameter(torch.empty_like(linear.bias), requires_grad=False))
            self.register_buffer("SCB", torch.empty(self.out_features, dtype=torch.float32))
            self.state = MatmulLtState()
            self.state.threshold, self.state.has_fp16_weights = threshold, False
            self.index = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.state.is_training = self.training
            self.state.CB, self.state.SCB = self.weight, self.SCB
            bias = self.bias
            if bias is not None and bias.dtype != x.dtype:
                bias = bias.to(x.dtype)
            if self.training:
                return MatMul8bitFp.apply(x, self.weight, None, bias, self.state)
            weight = self.weight.to(x.dtype).mul_(self.SCB.unsqueeze(1).mul(1.0 / 127.0))
            return torch.nn.functional.linear(x, weight, bias)

    return PaperLinear8bitLt


_CLASSES: dict[str, type] = {}


def quantize(model: torch.nn.Module, quantization: str | None, *, compute_dtype: torch.dtype = torch.bfloat16,
             double_quant: bool = True, threshold: float = 6.0) -> torch.nn.Module:
    """``model`` (built on the meta device) with the linear layers transformers would quantize replaced by the
    stand-ins, and the flags peft reads to dispatch its bitsandbytes LoRA layers. ``threshold``: LLM.int8's outlier
    threshold (BitsAndBytesConfig's default 6.0; training on CPU does not use it)."""
    if quantization is None:
        return model
    settings(quantization)  # the one-line refusal of anything else
    classes = _layers()
    from transformers import PreTrainedModel
    from transformers.integrations.bitsandbytes import should_convert_module
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert

    keep = get_keys_to_not_convert(model) if isinstance(model, PreTrainedModel) else []  # a bare module: every layer
    for name, module in list(model.named_modules()):
        if not name or not should_convert_module(name, keep):
            continue
        if isinstance(module, Conv1D):
            raise ValueError("quantization on paper: Conv1D layers (GPT-2 style) are not modelled; estimate a "
                             "model with nn.Linear layers")
        if type(module) is not torch.nn.Linear:
            continue
        with torch.device("meta"):
            new = (classes["nf4"](module, compute_dtype, "nf4", double_quant) if quantization == "nf4"
                   else classes["int8"](module, threshold))
        model.set_submodule(name, new)
    model.requires_grad_(False)  # a quantized base is frozen (from_pretrained leaves only what the user trains)
    model.is_loaded_in_4bit = quantization == "nf4"
    model.is_loaded_in_8bit = quantization == "int8"
    model.is_quantized = True
    return model


def quantized_model(model: torch.nn.Module, quantization: str | None, **options: Any) -> torch.nn.Module:
    """``model`` (just built on the meta device, LoRA or not) with its base quantized on paper. A peft model is
    unwrapped, its base quantized and wrapped again with the same config, so that peft dispatches the bitsandbytes
    LoRA layers it would put on a loaded quantized base."""
    if quantization is None:
        return model
    from peft import PeftModel, get_peft_model

    if not isinstance(model, PeftModel):
        return quantize(model, quantization, **options)
    from ..compat.gradient_checkpointing import peft_reads_quietly

    configs = dict(model.peft_config)
    if len(configs) != 1:
        raise ValueError(f"quantization on paper: a peft model with one adapter, not {len(configs)}")
    (name, config), = configs.items()
    # the dtypes the build gave the trainable weights (TRL's trainers cast a quantized base's adapters and
    # modules_to_save copies to bfloat16): get_peft_model makes the adapters anew, in float32
    dtypes = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    base = quantize(model.unload(), quantization, **options)
    with peft_reads_quietly():
        wrapped = get_peft_model(base, config, adapter_name=name)
    for n, p in wrapped.named_parameters():
        if n in dtypes and p.dtype != dtypes[n]:
            p.data = p.data.to(dtypes[n])
    return wrapped


def quantization_name(quantization: dict[str, Any] | None) -> str | None:
    """model.quantization (BitsAndBytesConfig keywords) as the estimate's ``quantization``: "nf4", "int8" or None."""
    if not quantization:
        return None
    if quantization.get("load_in_8bit"):
        return "int8"
    if not quantization.get("load_in_4bit"):
        return None
    kind = quantization.get("bnb_4bit_quant_type", "fp4")
    if kind != "nf4":
        raise ValueError(f"model.quantization.bnb_4bit_quant_type={kind}: the estimate models NF4 4-bit bases; set "
                         "bnb_4bit_quant_type=nf4, or probe for real")
    return "nf4"


def quantization_keywords(quantization: dict[str, Any] | None) -> dict[str, Any]:
    """`estimate_model`'s ``quantization`` and, where they differ from its defaults (bfloat16 compute, double
    quantization), ``quantization_options``, from BitsAndBytesConfig keywords (a recipe's model.quantization, or a
    loaded model's ``config.quantization_config.to_dict()``); {} for none. Absent keys are BitsAndBytesConfig's
    defaults (float32 compute, no double quantization)."""
    import torch

    name = quantization_name(quantization)
    if name is None:
        return {}
    keywords: dict[str, Any] = {"quantization": name}
    if name == "nf4":
        dtype = quantization.get("bnb_4bit_compute_dtype") or torch.float32
        dtype = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
        options = {"compute_dtype": dtype, "double_quant": bool(quantization.get("bnb_4bit_use_double_quant"))}
        if options != {"compute_dtype": torch.bfloat16, "double_quant": True}:
            keywords["quantization_options"] = options
    return keywords
