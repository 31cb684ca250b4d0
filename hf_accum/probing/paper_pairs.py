"""Preference pairs on paper: the step of TRL's DPO and reward trainers, for `estimate_model(pairs=...)`.

A micro-batch of m pairs is 2m rows, chosen then rejected, forwarded together (TRL's collators concatenate them so),
every row ``seq_len`` tokens with one padded position (two responses of a pair differ in length, so the real batch
always carries a padding mask).

- ``"dpo"`` follows `DPOTrainer._compute_loss` (sigmoid loss): TRL's fused LM head (`add_fused_lm_head`, with the
  outputs DPOTrainer asks of it: per-token log-probs, entropy, mean logits, top-1) on the policy, the sums over the
  completion, then the reference log-probs: read from the batch (``precompute_ref_log_probs``), or a forward under
  ``no_grad`` of the same model with its adapters disabled (LoRA: TRL's `use_adapter(model, None)`), or of a frozen
  copy of the model (full fine-tuning: TRL loads one; its weights are held beside the policy's and counted).
  Every position counts as a completion token (the fused head projects only those): the worst case.
- ``"reward"`` follows `RewardTrainer.compute_loss`: the rows through the model's scalar head (a sequence
  classification model with one label), -logsigmoid(chosen - rejected), mean over pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PAIRS = ("dpo", "reward")
#: The per-token outputs DPOTrainer asks of TRL's fused LM head (without WPO weighting).
DPO_HEAD_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")


@dataclass
class PairStep:
    """What the estimate runs for pairs: the batch factory, the loss of a batch, the line saying which loss, and
    tensors held outside the trained model (a full fine-tune's frozen reference copy)."""

    make_batch: Any
    forward: Any
    loss_line: str
    reference: torch.nn.Module | None = None


def is_peft(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def pair_batch(model: torch.nn.Module, seq_len: int, *, completion: bool, precomputed: bool):
    """``make_batch(m)``: 2m rows (chosen, then rejected), the last rejected row's last position padding."""
    vocab = int(model.config.vocab_size)

    def make_batch(micro: int) -> dict[str, Any]:
        rows = 2 * micro
        ids = torch.randint(0, vocab, (rows, seq_len))
        mask = torch.ones_like(ids)
        if seq_len > 1:
            mask[-1, -1] = 0
        batch = {"input_ids": ids, "attention_mask": mask}
        if completion:
            batch["completion_mask"] = mask.clone()
        if precomputed:
            batch["ref_chosen_logps"] = torch.zeros(micro)
            batch["ref_rejected_logps"] = torch.zeros(micro)
        return batch

    return make_batch


def step_for(pairs: str | None, model: torch.nn.Module, seq_len: int, *, precompute_ref_log_probs: bool = False,
             reference=None, beta: float = 0.1) -> PairStep | None:
    """The step for ``pairs`` on ``model`` (built on the meta device, before it is made fake), or None.
    ``reference``: a callable building the frozen reference model (full fine-tuning without precomputed log-probs)."""
    if pairs is None:
        if precompute_ref_log_probs:
            raise ValueError("precompute_ref_log_probs=True is for pairs='dpo'")
        return None
    if pairs not in PAIRS:
        raise ValueError(f"pairs={pairs!r}: give one of None, {', '.join(map(repr, PAIRS))}")
    if pairs == "reward":
        return _reward_step(model, seq_len)
    return _dpo_step(model, seq_len, precompute_ref_log_probs, reference, beta)


def _reward_step(model: torch.nn.Module, seq_len: int) -> PairStep:
    labels = getattr(model.config, "num_labels", None)
    head = model.get_base_model() if is_peft(model) else model
    if not type(head).__name__.endswith("ForSequenceClassification") or labels != 1:
        raise ValueError(f"pairs='reward' needs a sequence classification model with one label (the reward), not "
                         f"{type(head).__name__} (num_labels={labels}): build it with "
                         "AutoModelForSequenceClassification.from_config(config, num_labels=1)")

    def forward(model, batch):  # RewardTrainer.compute_loss (no margin, no centering)
        logits = model(**batch, use_cache=False).logits
        chosen, rejected = torch.chunk(logits.squeeze(-1), chunks=2)
        loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
        with torch.no_grad():  # its metrics
            (chosen > rejected).float().mean(), (chosen - rejected).mean()
        return loss

    return PairStep(pair_batch(model, seq_len, completion=False, precomputed=False), forward,
                    "loss: TRL's reward loss, -logsigmoid(chosen - rejected) through the scalar head (pairs='reward')")


def _dpo_step(model: torch.nn.Module, seq_len: int, precomputed: bool, reference, beta: float) -> PairStep:
    from trl.trainer.utils import add_fused_lm_head, use_adapter

    peft = is_peft(model)
    add_fused_lm_head(model.get_base_model() if peft else model, outputs=DPO_HEAD_OUTPUTS)
    ref_model = None
    if not precomputed and not peft:
        if reference is None:
            raise ValueError("pairs='dpo' on a full fine-tune needs the reference model (a frozen copy): pass "
                             "reference (a builder), or precompute_ref_log_probs=True")
        ref_model = reference()
        ref_model.requires_grad_(False)
        ref_model.eval()
        add_fused_lm_head(ref_model)

    def forward(model, batch):  # DPOTrainer._compute_loss, sigmoid loss, no length desensitization
        completion_mask = batch["completion_mask"]
        kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
        labels = batch["input_ids"].masked_fill(completion_mask == 0, -100)
        outputs = model(**kwargs, labels=labels, fused_lm_head=True)
        length = completion_mask.size(1) - 1
        chosen, rejected = outputs.log_probs[:, -length:].sum(dim=1).chunk(2, dim=0)
        if precomputed:
            ref_chosen, ref_rejected = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        else:
            with torch.no_grad():
                if ref_model is None:
                    with use_adapter(model, adapter_name=None):
                        ref = model(**kwargs, labels=labels, fused_lm_head=True)
                else:
                    ref = ref_model(**kwargs, labels=labels, fused_lm_head=True)
            ref_chosen, ref_rejected = ref.log_probs[:, -length:].sum(dim=1).chunk(2, dim=0)
            del ref
        delta = (chosen - ref_chosen) - (rejected - ref_rejected)
        loss = -torch.nn.functional.logsigmoid(beta * delta).mean()
        with torch.no_grad():  # its metrics: entropy, logits, accuracy over the completion tokens
            mask = completion_mask[:, 1:].bool()
            outputs.entropy[mask].mean(), outputs.mean_logits[mask].mean(), outputs.is_top1[mask].float().mean()
        return loss

    how = ("precomputed (read from the batch)" if precomputed else
           "the same model with its adapters disabled, under no_grad" if ref_model is None else
           "a frozen copy of the model (its weights held), under no_grad")
    step = PairStep(pair_batch(model, seq_len, completion=True, precomputed=precomputed), forward,
                    f"loss: TRL's DPO (sigmoid) through its fused LM head; reference log-probs {how} (pairs='dpo')")
    step.reference = ref_model
    return step


def reference_tensors(step: PairStep | None) -> list[torch.Tensor]:
    """The frozen reference model's weights and buffers (held beside the policy's), or none."""
    if step is None or step.reference is None:
        return []
    return list(step.reference.parameters()) + list(step.reference.buffers())
