"""transformers' run_clm.py and run_classification.py flows with our classes swapped in (issue 53): `HfArgumentParser`
over `AccumTrainingArguments` from the command line, the scripts' data handling (run_clm's `group_texts` into fixed
blocks and `default_data_collator`; run_classification's tokenizing and `DataCollatorWithPadding`), a tiny Llama and
an offline tokenizer, a target of 16 against plain `--per_device_train_batch_size 4 --gradient_accumulation_steps 4`.

run_clm: Llama's loss divides by `num_items_in_batch`, so plain Trainer is exact too: the losses agree to 1e-6.
run_classification: `LlamaForSequenceClassification.forward` takes **kwargs but ignores `num_items_in_batch`, so plain
Trainer (transformers 5.24) logs and steps the sum of the four micro-batch means (the 4x case); ours logs the
mean over the window's 16 samples, checked against an independent float64 reference (cross-entropy by hand)."""

import copy
from itertools import chain
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import (
    DataCollatorWithPadding,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from hf_accum import AccumTrainer, AccumTrainingArguments, tiny
from tests.exactness import logged_losses, recording

TOK = tiny.build_tokenizer()


def command(out, *extra) -> list[str]:
    return ["--output_dir", str(out), "--do_train", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "4", "--max_steps", "2", "--logging_steps", "1", "--learning_rate", "1e-3",
            "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--seed", "0", "--disable_tqdm", "True",
            *extra]


def parse(argv, cls):
    (args,) = HfArgumentParser((cls,)).parse_args_into_dataclasses(args=argv)
    return args


def clm_blocks(block_size: int = 16) -> Dataset:
    """run_clm.py: tokenize the text column, concatenate, cut into blocks of block_size, labels = input_ids."""
    texts = [r["prompt"] + " " + r["response"] for r in tiny.generate_instruction_data(120, seed=7)]
    tokenized = Dataset.from_dict({"text": texts}).map(lambda ex: TOK(ex["text"]), batched=True,
                                                       remove_columns=["text"])

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total = (len(concatenated["input_ids"]) // block_size) * block_size
        result = {k: [t[i: i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    return tokenized.map(group_texts, batched=True)


@pytest.mark.parametrize("target", [["--target_batch_size", "16"], []], ids=["target", "no_target"])
def test_run_clm_flow_agrees_with_plain_trainer(tmp_path, target):
    blocks = clm_blocks()
    assert len(blocks) >= 32
    losses = {}
    for name, trainer_cls, args_cls, extra in [("plain", Trainer, TrainingArguments, []),
                                               ("ours", AccumTrainer, AccumTrainingArguments, target)]:
        args = parse(command(tmp_path / name, *extra), args_cls)
        model = tiny.build_model("causal_lm", tokenizer=TOK, hidden_size=32)
        trainer = trainer_cls(model=model, args=args, train_dataset=blocks, data_collator=default_data_collator)
        trainer.train()
        losses[name] = logged_losses(trainer)
    assert len(losses["ours"]) == 2 and losses["ours"] == pytest.approx(losses["plain"], rel=1e-6)


def classification_data(n: int, seed: int) -> Dataset:
    rows = tiny.generate_classification_data(n, seed=seed)
    data = Dataset.from_list([{"sentence": r["text"], "label": int(r["label"])} for r in rows])
    return data.map(lambda ex: TOK(ex["sentence"], max_length=32, truncation=True), batched=True,
                    remove_columns=["sentence"])  # run_classification.py's preprocess_function


def test_run_classification_flow_the_4x_case(tmp_path):
    data = classification_data(16, seed=8)
    initial = tiny.build_model("seq_cls", tokenizer=TOK, hidden_size=32)
    trainers = {}
    for name, trainer_cls, args_cls, extra in [("plain", Trainer, TrainingArguments, []),
                                               ("ours", AccumTrainer, AccumTrainingArguments,
                                                ["--target_batch_size", "16", "--loss_normalization", "samples"])]:
        args = parse(command(tmp_path / name, "--max_steps", "1", *extra), args_cls)
        trainer = recording(trainer_cls)(model=copy.deepcopy(initial), args=args, train_dataset=data,
                                         data_collator=DataCollatorWithPadding(TOK), processing_class=TOK)
        trainer.train()
        trainers[name] = trainer
    model = copy.deepcopy(initial).double().eval()

    def losses(batch):  # per-sample cross-entropy by hand, float64
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return -torch.log_softmax(logits, -1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)

    window = trainers["plain"].windows[0]
    per_batch = [losses(b) for b in window]
    exact = float(torch.cat(per_batch).mean())
    sum_of_means = sum(float(x.mean()) for x in per_batch)
    plain, ours = logged_losses(trainers["plain"])[0], logged_losses(trainers["ours"])[0]
    assert plain == pytest.approx(sum_of_means, rel=1e-5) and 3.5 < plain / exact < 4.5
    assert ours == pytest.approx(exact, rel=1e-5)
    manual = (Path(__file__).resolve().parents[1] / "docs" / "exactness.md").read_text()
    assert f"`Trainer` {plain:.4f} | `AccumTrainer` {ours:.4f} | {exact:.4f} |" in manual  # "The 4× case"
    print(f"\n4x case (Llama sequence classification, 16 = 4 x 4): plain Trainer logs {plain:.4f} (sum of micro-batch "
          f"means {sum_of_means:.4f}); AccumTrainer {ours:.4f}; float64 reference {exact:.4f}")
