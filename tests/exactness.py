"""Shared harness for the exactness tests and `benchmarks/bench_exactness.py`.

A run records, at every optimizer step, the gradient the optimizer is about to use, the weights it applies to,
and the micro-batches each rank trained on. The reference recomputes each step's gradient independently: one
forward over all of the step's samples (every micro-batch, every rank) padded together, and plain
`torch.nn.functional.cross_entropy` summed over the counted labels divided by their number (or the mean over
samples) -- never through the library's loss code or the model's own loss.
"""

from __future__ import annotations

import copy
import json
import random
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    T5Config,
    T5ForConditionalGeneration,
    TrainerCallback,
)
from transformers.trainer_callback import PrinterCallback

VOCAB = 97
PAD = 0


# --- data -----------------------------------------------------------------------------------------------------
def lm_examples(n: int, seed: int = 0, min_len: int = 4, max_len: int = 40) -> list[dict]:
    """Unpadded causal-LM examples whose prompt (label -100) and target lengths vary a lot, as real SFT data."""
    g = random.Random(seed)
    out = []
    for _ in range(n):
        length = g.randint(min_len, max_len)
        ids = [g.randint(1, VOCAB - 1) for _ in range(length)]
        prompt = g.randint(1, length - 1)
        labels = [-100] * prompt + ids[prompt:]
        out.append({"input_ids": ids, "labels": labels})
    return out


def seq2seq_examples(n: int, seed: int = 0) -> list[dict]:
    g = random.Random(seed)
    out = []
    for _ in range(n):
        src = [g.randint(1, VOCAB - 1) for _ in range(g.randint(3, 20))]
        tgt = [g.randint(1, VOCAB - 1) for _ in range(g.randint(1, 16))]
        out.append({"input_ids": src, "labels": tgt})
    return out


def cls_examples(n: int, seed: int = 0, num_labels: int = 3) -> list[dict]:
    g = random.Random(seed)
    return [
        {"input_ids": [g.randint(1, VOCAB - 1) for _ in range(g.randint(3, 24))], "labels": g.randrange(num_labels)}
        for _ in range(n)
    ]


def pad_collate(examples: list[dict]) -> dict:
    """Right-pads to the longest example of this micro-batch, so micro-batches have different lengths."""
    width = max(len(e["input_ids"]) for e in examples)
    batch = {
        "input_ids": torch.tensor([e["input_ids"] + [PAD] * (width - len(e["input_ids"])) for e in examples]),
        "attention_mask": torch.tensor([[1] * len(e["input_ids"]) + [0] * (width - len(e["input_ids"])) for e in examples]),
    }
    first = examples[0]["labels"]
    if isinstance(first, int):
        batch["labels"] = torch.tensor([e["labels"] for e in examples])
    else:
        lw = max(len(e["labels"]) for e in examples)
        batch["labels"] = torch.tensor([e["labels"] + [-100] * (lw - len(e["labels"])) for e in examples])
    return batch


def merge(batches: list[dict]) -> dict:
    """Concatenate micro-batches into one batch padded to the longest (the reference's single pass)."""
    def pad_to(t, width, value):
        return F.pad(t, (0, width - t.shape[1]), value=value) if t.dim() == 2 else t

    out = {}
    for key in batches[0]:
        width = max(b[key].shape[1] for b in batches) if batches[0][key].dim() == 2 else None
        value = -100 if key == "labels" else 0
        out[key] = torch.cat([pad_to(b[key], width, value) for b in batches])
    return out


# --- models ---------------------------------------------------------------------------------------------------
def tiny_llama(dtype=torch.float64, seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    cfg = LlamaConfig(vocab_size=VOCAB, pad_token_id=PAD, **{**sizes, **overrides})
    return LlamaForCausalLM(cfg).to(dtype)


def probe_llama(seed: int = 0) -> LlamaForCausalLM:
    """float32 Llama with a 256-token vocabulary for the meter and probe tests (memory, not exactness)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float()


def tiny_gpt2(dtype=torch.float64, seed: int = 0):
    """Float64 all the way through (Llama runs RMSNorm in float32): for tests that compare runs to 1e-10."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=PAD)
    return GPT2LMHeadModel(cfg).to(dtype)


def tiny_llama_cls(dtype=torch.float64, seed: int = 0, num_labels: int = 3) -> LlamaForSequenceClassification:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, num_labels=num_labels,
    )
    return LlamaForSequenceClassification(cfg).to(dtype)


def tiny_t5(dtype=torch.float64, seed: int = 0) -> T5ForConditionalGeneration:
    torch.manual_seed(seed)
    cfg = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, pad_token_id=PAD, decoder_start_token_id=PAD, eos_token_id=1,
    )
    return T5ForConditionalGeneration(cfg).to(dtype)


def tiny_bart(dtype=torch.float64, seed: int = 0) -> BartForConditionalGeneration:
    """BART's `forward` takes **kwargs but ignores `num_items_in_batch`: each forward returns its own token mean."""
    torch.manual_seed(seed)
    cfg = BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=PAD, bos_token_id=2, eos_token_id=1,
        decoder_start_token_id=2, forced_eos_token_id=None,
    )
    return BartForConditionalGeneration(cfg).to(dtype)


class NoLossKwargsLlama(LlamaForCausalLM):
    """A model class that, like several multimodal models in transformers 5.x, declines `num_items_in_batch`."""

    accepts_loss_kwargs = False


class ExplicitArgsWrapper(nn.Module):
    """A user's wrapper whose forward has explicit arguments and no **kwargs; returns the model's mean loss."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def train_recording_outcome(trainer, path: str, *, reraise: bool = True, show: bool = False) -> None:
    """``trainer.train()`` in a launched worker, writing what it raised (or None) and the step it reached to
    ``path`` whatever happens, then re-raising: the test reads every rank's outcome.

    ``reraise=False`` is for the rank a failure is injected into: it records and exits cleanly. torchrun sends
    SIGTERM to every other rank as soon as one exits with an error, and a rank that learns of the stop only when
    that rank leaves (its pending collective fails then) could be ended before it writes its own record.
    ``show=True`` prints what it raised as an uncaught exception would be (``sys.excepthook``: torch's adds the
    "[rankN]: " prefixes), for a test that reads the rank's traceback while the rank exits cleanly."""
    raised = None
    try:
        trainer.train()
    except BaseException as exc:
        raised = {"type": type(exc).__name__, "message": str(exc)}
        if show:
            sys.excepthook(*sys.exc_info())
        if reraise:
            raise
    finally:
        with open(path, "w") as f:
            json.dump({"raised": raised, "step": trainer.state.global_step}, f)


# --- recording runs -------------------------------------------------------------------------------------------
class StepRecorder(TrainerCallback):
    """Records, before each optimizer step, the gradients and the weights they belong to."""

    def __init__(self):
        self.grads: list[dict[str, torch.Tensor]] = []
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.grads.append({n: p.grad.detach().clone() for n, p in named})
        self.weights.append({n: p.detach().clone() for n, p in model.named_parameters()})


class ForwardSizes(TrainerCallback):
    """The rows of every training forward of ``model`` once training begins (the probe's steps come before)."""

    def __init__(self, model: nn.Module):
        self.sizes: list[int] = []
        self._on = False
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self._on and module.training and torch.is_tensor(ids):
            self.sizes.append(int(ids.shape[0]))

    def on_train_begin(self, args, state, control, **kwargs):
        self._on = True


def recording(trainer_cls):
    """Subclass of ``trainer_cls`` that keeps every micro-batch it trains on, grouped by optimizer step."""

    class Recording(trainer_cls):
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            batches, n = super().get_batch_samples(epoch_iterator, num_batches, device)
            self.windows = getattr(self, "windows", [])
            self.windows.append([{k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in b.items()}
                                 for b in batches])  # TRL's padding-free batches carry ints (max_length_q)
            return batches, n

    Recording.__name__ = f"Recording{trainer_cls.__name__}"
    return Recording


# --- the independent reference ----------------------------------------------------------------------------------
@dataclass
class Reference:
    kind: str  # "causal", "seq2seq", "cls"
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def reference_step(model: nn.Module, batches: list[dict], kind: str, label_smoothing: float = 0.0):
    """Gradient and loss of one pass over every sample of the step, loss computed by hand from the logits."""
    batch = merge(batches)
    model.zero_grad(set_to_none=True)
    model.train()
    if kind == "causal":
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logits, labels = logits[:, :-1], batch["labels"][:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                               reduction="sum", label_smoothing=label_smoothing) / labels.ne(-100).sum()
    elif kind == "seq2seq":
        dec = model.prepare_decoder_input_ids_from_labels(labels=batch["labels"])  # T5: _shift_right; BART: its own
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       decoder_input_ids=dec).logits
        labels = batch["labels"]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                               reduction="sum", label_smoothing=label_smoothing) / labels.ne(-100).sum()
    elif kind == "cls":
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits, batch["labels"], reduction="sum", label_smoothing=label_smoothing)
        loss = loss / batch["labels"].shape[0]
    else:
        raise ValueError(kind)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, float(loss.detach())


def load_weights(model: nn.Module, weights: dict[str, torch.Tensor], name_map=lambda n: n) -> None:
    """Set a reference model to the weights recorded before a step."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, w in weights.items():
            params[name_map(n)].copy_(w)


def reference_run(initial_model: nn.Module, recorder: StepRecorder, windows: list[list[dict]], kind: str,
                  name_map=lambda n: n, label_smoothing: float = 0.0) -> Reference:
    """Recompute every recorded step from the recorded weights; ``windows[s]`` holds all ranks' micro-batches."""
    ref = Reference(kind)
    model = copy.deepcopy(initial_model)
    params = dict(model.named_parameters())
    for weights, batches in zip(recorder.weights, windows):
        with torch.no_grad():
            for n, w in weights.items():
                params[name_map(n)].copy_(w)
        grads, loss = reference_step(model, batches, kind, label_smoothing)
        ref.grads.append(grads)
        ref.losses.append(loss)
    return ref


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], name_map=lambda n: n) -> float:
    num = sum(float((g.double() - want[name_map(n)].double()).pow(2).sum()) for n, g in got.items())
    den = sum(float(want[name_map(n)].double().pow(2).sum()) for n in got)
    return (num / den) ** 0.5


def max_relative_error(recorded: list[dict[str, torch.Tensor]], wanted: list[dict[str, torch.Tensor]]) -> float:
    """Largest per-step relative gradient error over the parameters of ``wanted``."""
    assert len(recorded) == len(wanted) > 0
    return max(relative_error({n: got[n] for n in want}, want) for got, want in zip(recorded, wanted))


def max_step_error(recorder: StepRecorder, ref: Reference, name_map=lambda n: n) -> float:
    assert len(recorder.grads) == len(ref.grads) > 0
    return max(relative_error(g, r, name_map) for g, r in zip(recorder.grads, ref.grads))


def logged_losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


# --- the case table shared by tests and the benchmark ---------------------------------------------------------
class MeanCrossEntropyLoss:
    """Mixin: the tutorial-style `compute_loss` override returning the mean cross-entropy of its micro-batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        logits, labels = out.logits[:, :-1], inputs["labels"][:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return (loss, out) if return_outputs else loss


def sum_over_items_loss(outputs, labels, num_items_in_batch=None):
    """A user's `compute_loss_func`: token-loss sum over the count it is given."""
    logits, labels = outputs.logits[:, :-1], labels[:, 1:]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total / num_items_in_batch


def lora(model):
    from peft import LoraConfig, get_peft_model

    # init_lora_weights=False: B is random too, so both adapter matrices get non-zero gradients at step 1.
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0, init_lora_weights=False))


@dataclass
class Case:
    name: str
    model: object  # () -> nn.Module
    kind: str = "causal"
    data: object = lambda: lm_examples(16, seed=1)
    args: dict = field(default_factory=dict)
    mixin: type | None = None
    trainer_kwargs: dict = field(default_factory=dict)
    label_smoothing: float = 0.0
    normalization: str = "tokens"


CASES = {
    c.name: c
    for c in [
        Case("causal_lm", tiny_llama),
        Case("no_loss_kwargs_class", lambda: _as(NoLossKwargsLlama, tiny_llama())),
        Case("explicit_args_wrapper", lambda: ExplicitArgsWrapper(tiny_llama())),
        Case("compute_loss_override_mean", tiny_llama, mixin=MeanCrossEntropyLoss),
        Case("label_smoothing", tiny_llama, args={"label_smoothing_factor": 0.1}, label_smoothing=0.1),
        Case("compute_loss_func", tiny_llama, trainer_kwargs={"compute_loss_func": sum_over_items_loss}),
        Case("peft_lora", lambda: lora(tiny_llama())),
        Case("gradient_checkpointing", tiny_llama,
             args={"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}),
        Case("t5_seq2seq", tiny_t5, kind="seq2seq", data=lambda: seq2seq_examples(16, seed=2)),
        Case("seq_classification_samples", tiny_llama_cls, kind="cls", data=lambda: cls_examples(16, seed=3),
             normalization="samples"),
    ]
}


def _as(cls, model):
    """Re-class a built model (same weights) as a subclass, e.g. one that declines loss kwargs."""
    model.__class__ = cls
    return model


def run_case(case: Case, base_trainer_cls, output_dir: str, micro: int = 3, accum: int = 4, forward_sizes: bool = False,
             **arg_overrides):
    """Train one epoch on the case and return (max relative gradient error, logged losses, reference losses)."""
    from transformers import TrainingArguments

    from hf_accum import AccumTrainer, AccumTrainingArguments

    model = case.model()
    initial = copy.deepcopy(model)
    accum_trainer = issubclass(base_trainer_cls, AccumTrainer)
    kwargs = dict(
        output_dir=output_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        num_train_epochs=1, learning_rate=1e-2, max_grad_norm=0.0, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, remove_unused_columns=False,
        **case.args, **arg_overrides,
    )
    if accum_trainer:
        args = AccumTrainingArguments(loss_normalization=case.normalization, **kwargs)
    else:
        args = TrainingArguments(**kwargs)
    cls = recording(base_trainer_cls if case.mixin is None else type("User", (case.mixin, base_trainer_cls), {}))
    recorder = StepRecorder()
    callbacks = [recorder, ForwardSizes(model)] if forward_sizes else [recorder]
    trainer = cls(model=model, args=args, train_dataset=case.data(), data_collator=pad_collate, callbacks=callbacks,
                  **case.trainer_kwargs)
    trainer.forward_sizes = callbacks[-1]
    trainer.remove_callback(PrinterCallback)  # keeps benchmark tables readable
    trainer.train()
    ref = reference_run(initial, recorder, trainer.windows, case.kind, label_smoothing=case.label_smoothing)
    return max_step_error(recorder, ref), logged_losses(trainer), ref.losses, trainer
