"""transformers' example flows with our classes swapped in by two names (issue 53): run_summarization.py (BART) and
run_translation.py (T5) as a user runs them: `HfArgumentParser` over `AccumSeq2SeqTrainingArguments` from the
command line, the scripts' preprocessing (prefix, `text_target`, truncation) and `DataCollatorForSeq2Seq`, then
train, evaluate with generation and predict, with a target and without; tiny models and an offline tokenizer.

The 4x case (docs/exactness.md): BART's forward ignores `num_items_in_batch`, so plain `Seq2SeqTrainer` at
`--per_device_train_batch_size 4 --gradient_accumulation_steps 4` logs and steps the sum of the four micro-batch
means; ours logs the mean over the window's target tokens. Both are checked against an independent float64
reference (the model's logits, cross-entropy by hand): the plain value against the recorded micro-batches one by one,
ours against the whole window."""

import copy
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
)

from hf_accum import AccumSeq2SeqTrainer, AccumSeq2SeqTrainingArguments, tiny
from tests.exactness import logged_losses, recording

TOK = tiny.build_tokenizer()
ROOT = Path(__file__).resolve().parents[1]


def bart():
    torch.manual_seed(0)
    return BartForConditionalGeneration(BartConfig(
        vocab_size=len(TOK), d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=128,
        pad_token_id=TOK.pad_token_id, bos_token_id=TOK.bos_token_id, eos_token_id=TOK.eos_token_id,
        decoder_start_token_id=TOK.bos_token_id, forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0))


def t5():
    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=len(TOK), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        pad_token_id=TOK.pad_token_id, eos_token_id=TOK.eos_token_id, decoder_start_token_id=TOK.pad_token_id, dropout_rate=0.0))


def summarization_data(n: int, seed: int = 0) -> Dataset:
    rows = tiny.generate_instruction_data(n, seed=seed)
    return Dataset.from_list([{"document": r["prompt"], "summary": r["response"]} for r in rows])


def translation_data(n: int, seed: int = 0) -> Dataset:
    rows = tiny.generate_instruction_data(n, seed=seed)
    return Dataset.from_list([{"translation": {"en": r["prompt"], "ro": r["response"]}} for r in rows])


def summarization_preprocess(examples, prefix="", max_source_length=48, max_target_length=24):
    """run_summarization.py's preprocess_function (padding False, its default)."""
    inputs = [prefix + doc for doc in examples["document"]]
    model_inputs = TOK(inputs, max_length=max_source_length, truncation=True)
    labels = TOK(text_target=examples["summary"], max_length=max_target_length, truncation=True)
    model_inputs["labels"] = labels["input_ids"]
    return model_inputs


def translation_preprocess(examples, prefix="translate English to Romanian: ", max_length=64):
    """run_translation.py's preprocess_function."""
    inputs = [prefix + ex["en"] for ex in examples["translation"]]
    targets = [ex["ro"] for ex in examples["translation"]]
    return TOK(inputs, text_target=targets, max_length=max_length, truncation=True)


def compute_metrics(eval_preds):
    """The scripts' postprocessing (-100 back to pad, decode), with exact match in place of ROUGE / BLEU (offline)."""
    preds, labels = eval_preds
    preds = preds[0] if isinstance(preds, tuple) else preds
    preds = [[t for t in row if t >= 0] for row in preds.tolist()]
    labels = [[t if t != -100 else TOK.pad_token_id for t in row] for row in labels.tolist()]
    decoded = TOK.batch_decode(preds, skip_special_tokens=True)
    wanted = TOK.batch_decode(labels, skip_special_tokens=True)
    return {"exact_match": sum(p.strip() == w.strip() for p, w in zip(decoded, wanted)) / len(wanted)}


def parse(argv: list[str], cls=AccumSeq2SeqTrainingArguments):
    (args,) = HfArgumentParser((cls,)).parse_args_into_dataclasses(args=argv)
    return args


def command(out, *extra) -> list[str]:
    return ["--output_dir", str(out), "--do_train", "--do_eval", "--do_predict", "--predict_with_generate",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4",
            "--per_device_eval_batch_size", "4", "--generation_max_length", "16", "--max_steps", "2",
            "--logging_steps", "1", "--optim", "sgd", "--learning_rate", "0.5", "--lr_scheduler_type", "constant",
            "--max_grad_norm", "0", "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--seed", "0",
            "--disable_tqdm", "True", *extra]


def run_flow(trainer_cls, args, model, train, dev):
    collator = DataCollatorForSeq2Seq(TOK, model=model, label_pad_token_id=-100)
    trainer = trainer_cls(model=model, args=args, train_dataset=train, eval_dataset=dev, processing_class=TOK,
                          data_collator=collator, compute_metrics=compute_metrics)
    trainer.train()
    metrics = trainer.evaluate(max_length=args.generation_max_length, num_beams=1, metric_key_prefix="eval")
    predicted = trainer.predict(dev, metric_key_prefix="predict")
    return trainer, metrics, predicted


def window_loss(model, batches: list[dict]) -> float:
    """The mean over every target token of ``batches``: one float64 forward each, cross-entropy by hand."""
    model = copy.deepcopy(model).double().eval()  # no dropout in these configs either way
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                           decoder_input_ids=b["decoder_input_ids"]).logits
            logp = torch.log_softmax(logits, -1)
            mask = b["labels"].ne(-100)
            picked = logp.gather(-1, b["labels"].clamp(min=0).unsqueeze(-1)).squeeze(-1)
            total += float(-(picked * mask).sum())
            count += int(mask.sum())
    return total / count


@pytest.mark.parametrize("target", [["--target_batch_size", "16"], []], ids=["target", "no_target"])
def test_run_summarization_flow_trains_evaluates_with_generation_and_predicts(tmp_path, target):
    args = parse(command(tmp_path, *target))
    assert args.predict_with_generate and args.generation_max_length == 16
    assert args.target_batch_size == (16 if target else None)
    data = summarization_data(40)
    train = data.select(range(32)).map(summarization_preprocess, batched=True, remove_columns=data.column_names)
    dev = data.select(range(32, 40)).map(summarization_preprocess, batched=True, remove_columns=data.column_names)
    trainer, metrics, predicted = run_flow(AccumSeq2SeqTrainer, args, bart(), train, dev)
    assert trainer.state.global_step == 2 and len(logged_losses(trainer)) == 2
    assert {"eval_loss", "eval_exact_match"} <= set(metrics)
    assert predicted.predictions.shape[0] == 8 and "predict_exact_match" in predicted.metrics


@pytest.mark.parametrize("target", [["--target_batch_size", "16"], []], ids=["target", "no_target"])
def test_run_translation_flow_with_t5_trains_evaluates_and_predicts(tmp_path, target):
    args = parse(command(tmp_path, *target, "--generation_num_beams", "2"))
    data = translation_data(40, seed=1)
    train = data.select(range(32)).map(translation_preprocess, batched=True, remove_columns=data.column_names)
    dev = data.select(range(32, 40)).map(translation_preprocess, batched=True, remove_columns=data.column_names)
    trainer, metrics, predicted = run_flow(AccumSeq2SeqTrainer, args, t5(), train, dev)
    assert trainer.state.global_step == 2
    assert {"eval_loss", "eval_exact_match"} <= set(metrics) and predicted.predictions.shape[0] == 8


def test_the_4x_case_plain_logs_the_sum_of_micro_batch_means_ours_the_windows_mean(tmp_path):
    data = summarization_data(16, seed=4)
    train = data.map(summarization_preprocess, batched=True, remove_columns=data.column_names)
    dev = train.select(range(4))
    initial = bart()
    results = {}
    for name, trainer_cls, args_cls, extra in [
            ("plain", Seq2SeqTrainer, Seq2SeqTrainingArguments, []),
            ("ours", AccumSeq2SeqTrainer, AccumSeq2SeqTrainingArguments, ["--target_batch_size", "16"])]:
        args = parse(command(tmp_path / name, "--max_steps", "1", *extra), args_cls)
        trainer, _, _ = run_flow(recording(trainer_cls), args, copy.deepcopy(initial), train, dev)
        results[name] = trainer
    window = results["plain"].windows[0]
    assert sum(len(b["input_ids"]) for b in window) == 16
    exact = window_loss(initial, window)
    sum_of_means = sum(window_loss(initial, [b]) for b in window)
    plain, ours = logged_losses(results["plain"])[0], logged_losses(results["ours"])[0]
    assert plain == pytest.approx(sum_of_means, rel=1e-5) and 3.5 < plain / exact < 4.5
    assert ours == pytest.approx(exact, rel=1e-5)
    # the numbers the manual's and README's 4x rows state (docs/exactness.md, "The 4× case")
    manual, readme = (ROOT / "docs" / "exactness.md").read_text(), (ROOT / "README.md").read_text()
    tokens = sum(int(b["labels"].ne(-100).sum()) for b in window)
    assert f"`Seq2SeqTrainer` {plain:.4f} | `AccumSeq2SeqTrainer` {ours:.4f} | {exact:.4f} |" in manual
    assert f"{tokens} target tokens" in manual and f"{tokens} target tokens" in readme
    assert f"`AccumSeq2SeqTrainer` {ours:.4f} = the float64 reference; `Seq2SeqTrainer` {plain:.4f}" in readme
    print(f"\n4x case (BART, 16 = 4 x 4, {sum(int(b['labels'].ne(-100).sum()) for b in window)} target tokens): "
          f"plain Seq2SeqTrainer logs {plain:.4f} (sum of micro-batch means {sum_of_means:.4f}); "
          f"AccumSeq2SeqTrainer {ours:.4f}; float64 reference {exact:.4f}")


def test_with_targets_of_one_length_plain_is_exactly_four_times_ours(tmp_path):
    """T5, like BART, returns its micro-batch mean whatever num_items_in_batch says. With every target of one length
    (as run_clm's fixed blocks) the window's mean is the mean of the micro-batch means: plain's logged value is
    exactly 4x ours, to float32 rounding."""
    rows = [{"document": r["prompt"], "summary": (r["response"] * 8)[:12]}
            for r in tiny.generate_instruction_data(16, seed=6)]
    train = Dataset.from_list(rows).map(summarization_preprocess, batched=True, remove_columns=["document", "summary"])
    out = {}
    for name, trainer_cls, args_cls in [("plain", Seq2SeqTrainer, Seq2SeqTrainingArguments),
                                        ("ours", AccumSeq2SeqTrainer, AccumSeq2SeqTrainingArguments)]:
        args = parse(command(tmp_path / name, "--max_steps", "1"), args_cls)
        trainer, _, _ = run_flow(trainer_cls, args, t5(), train, train.select(range(4)))
        out[name] = logged_losses(trainer)[0]
    assert out["plain"] == pytest.approx(4 * out["ours"], rel=1e-6)
