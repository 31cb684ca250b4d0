"""Which labels count: `label_names`, an ignore index other than -100 read from the model's config (SegFormer's
`semantic_loss_ignore_index`), and a clear refusal for a model whose loss hf_accum cannot drive exactly.
References are independent: one pass over every sample of the step, cross-entropy by hand, float64."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import SegformerConfig, SegformerForSemanticSegmentation
from transformers.trainer_callback import PrinterCallback

from hf_accum import AccumTrainer, AccumTrainingArguments
from tests.exactness import (
    ExplicitArgsWrapper,
    StepRecorder,
    lm_examples,
    load_weights,
    merge,
    pad_collate,
    recording,
    relative_error,
    tiny_llama,
)


def args_for(tmp_path, micro, accum, **kw):
    return AccumTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        num_train_epochs=1, learning_rate=1e-2, max_grad_norm=0.0, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, remove_unused_columns=False, **kw,
    )


# --- SegFormer: ignore index 255 -------------------------------------------------------------------------------
def tiny_segformer(num_labels=4):
    torch.manual_seed(0)
    cfg = SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                          patch_sizes=[3, 3], strides=[2, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                          decoder_hidden_size=16, num_labels=num_labels, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, drop_path_rate=0.0)
    model = SegformerForSemanticSegmentation(cfg).double()
    # BatchNorm in train mode normalizes over the forward's own images, so no accumulation (ours or anyone's) can
    # equal one pass; take it out to test what this file is about: which labels the loss counts.
    model.decode_head.batch_norm = nn.Identity()
    return model


def segmentation_data(n=12, size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        labels = torch.randint(0, 4, (size, size), generator=g)
        ignored = torch.rand(size, size, generator=g) < (0.1 + 0.07 * i)  # 10% .. 87% of pixels ignored
        out.append({"pixel_values": torch.randn(3, size, size, generator=g, dtype=torch.float64),
                    "labels": labels.masked_fill(ignored, 255)})
    return out


def stack(examples):
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


def segmentation_reference(initial, recorder, windows):
    model = copy.deepcopy(initial)
    grads = []
    for weights, window in zip(recorder.weights, windows):
        load_weights(model, weights)
        model.zero_grad(set_to_none=True)
        batch = {k: torch.cat([b[k] for b in window]) for k in window[0]}
        logits = model(pixel_values=batch["pixel_values"]).logits
        logits = F.interpolate(logits, size=batch["labels"].shape[-2:], mode="bilinear", align_corners=False)
        labels = batch["labels"]
        loss = F.cross_entropy(logits, labels, ignore_index=255, reduction="sum") / labels.ne(255).sum()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return grads


def test_segformer_counts_the_pixels_its_loss_keeps(tmp_path):
    model = tiny_segformer()
    initial = copy.deepcopy(model)
    recorder = StepRecorder()
    trainer = recording(AccumTrainer)(model=model, args=args_for(tmp_path, 2, 3), train_dataset=segmentation_data(),
                                      data_collator=stack, callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    assert trainer._engine.cutter.labels.ignore_index == 255
    ref = segmentation_reference(initial, recorder, trainer.windows)
    assert max(relative_error(g, r) for g, r in zip(recorder.grads, ref)) <= 1e-6


def test_a_model_whose_loss_skips_an_unknown_label_is_refused_before_training(tmp_path):
    model = tiny_segformer(num_labels=1)  # its binary loss averages over all pixels, ignored ones included
    trainer = AccumTrainer(model=model, args=args_for(tmp_path, 2, 1), train_dataset=segmentation_data(4),
                           data_collator=stack)
    weights = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"SegformerForSemanticSegmentation computes its loss skipping label 255 "
                                         r"\(config.semantic_loss_ignore_index\).*loss_normalization='model'"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


# --- label_names ------------------------------------------------------------------------------------------------
class TargetsWrapper(ExplicitArgsWrapper):
    """A user's model whose labels live under another key, declared with `label_names=["targets"]`."""

    def forward(self, input_ids, attention_mask=None, targets=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=targets)


def rename(collate):
    def wrapped(examples):
        batch = collate(examples)
        batch["targets"] = batch.pop("labels")
        return batch
    return wrapped


def test_label_names_are_where_labels_are_counted(tmp_path):
    model = TargetsWrapper(tiny_llama())
    initial = copy.deepcopy(model)
    recorder = StepRecorder()
    trainer = recording(AccumTrainer)(model=model, args=args_for(tmp_path, 3, 2, label_names=["targets"]),
                                      train_dataset=lm_examples(12, seed=7), data_collator=rename(pad_collate),
                                      callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    errs = []
    for weights, window, got in zip(recorder.weights, trainer.windows, recorder.grads):
        ref_model = copy.deepcopy(initial)
        with torch.no_grad():
            for n, p in ref_model.named_parameters():
                p.copy_(weights[n])
        batch = merge([{**b, "labels": b["targets"]} for b in window])
        logits = ref_model.inner(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
        (loss / labels.ne(-100).sum()).backward()
        errs.append(relative_error(got, {n: p.grad for n, p in ref_model.named_parameters()}))
    assert max(errs) <= 1e-6
