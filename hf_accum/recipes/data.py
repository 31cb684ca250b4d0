"""Step 3 of a recipe: the data. Rows (generated tiny data, a local file or a hub dataset) tokenized into training
examples, the collator, and per-example token statistics."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..loading import hub_unreachable
from ..loss import IGNORE_INDEX
from .config import DATA_FILE_BUILDERS, DataSection, Recipe, RecipeError


@dataclass
class RecipeData:
    dataset: Any
    collator: Any
    num_labels: int | None
    mean_tokens: float
    mean_targets: float
    longest: int


def build_data(recipe: Recipe, tokenizer) -> RecipeData:
    """Tokenized training examples (a list-backed torch Dataset), the collator and per-example token statistics."""
    from .. import tiny

    d, task = recipe.data, recipe.model.task
    num_labels = recipe.model.num_labels
    if d.dataset == "tiny":
        n = d.num_examples or 2000
        if task == "causal_lm":
            dataset = tiny.build_sft_dataset(n, tokenizer, max_length=d.max_length, seed=d.seed)
        else:
            dataset = tiny.build_classification_dataset(n, tokenizer, max_length=d.max_length, seed=d.seed)
            num_labels = num_labels or 2
    else:
        rows = _load_rows(d)
        if task == "causal_lm":
            tokenized = [_tokenize_sft_row(r, tokenizer, d) for r in rows]
            dataset = tiny.ListDataset([r for r in tokenized if _target_count(r["labels"]) > 0])
        else:
            rows, num_labels = _classification_rows(rows, d, num_labels)
            dataset = tiny.ListDataset([tiny.tokenize_classification(r, tokenizer, d.max_length) for r in rows])
    if len(dataset) == 0:
        raise RecipeError(f"data.dataset={d.dataset!r} gave no training example with a target token after tokenization")
    if task == "causal_lm":
        collator, targets = tiny.SFTCollator(tokenizer), [_target_count(r["labels"]) for r in dataset.rows]
    else:
        collator, targets = tiny.ClassificationCollator(tokenizer), [1] * len(dataset)
    lengths = [len(r["input_ids"]) for r in dataset.rows]
    return RecipeData(
        dataset, collator, num_labels, sum(lengths) / len(lengths), sum(targets) / len(targets), max(lengths)
    )


def _target_count(labels) -> int:
    return sum(x != -100 for x in labels[1:])  # causal shift: position 0 is never predicted


def _load_rows(d: DataSection):
    """The rows of a local file (checked first, so a bad file is named with its line) or a hub / directory dataset."""
    path = Path(d.dataset)
    suffix = path.suffix.lower()
    if suffix in DATA_FILE_BUILDERS:
        _check_data_file(d.dataset, path)
        ds = _load_dataset(d.dataset, DATA_FILE_BUILDERS[suffix], data_files=str(path), split="train")
    else:
        if not path.exists():
            unreachable = hub_unreachable("data.dataset", d.dataset, kind="dataset")
            if unreachable is not None:
                raise RecipeError(str(unreachable))
        ds = _load_dataset(d.dataset, d.dataset, d.subset, split=d.split)
    if len(ds) == 0:
        raise RecipeError(f"data.dataset={d.dataset!r} has no rows; give a dataset with at least one example")
    if d.num_examples is not None:
        ds = ds.select(range(min(d.num_examples, len(ds))))
    return ds


def _load_dataset(name: str, *args, **kwargs):
    from datasets import load_dataset

    try:
        return load_dataset(*args, **kwargs)
    except Exception as exc:  # datasets' errors are long and name its internals: say which file and what
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise RecipeError(f"data.dataset={name!r} could not be read: {reason[:300]}") from None


def _check_data_file(name: str, path: Path) -> None:
    """Empty files, JSON that does not parse (with the line), CSV with a header and no rows."""
    import json

    label = f"data.dataset={name!r}"
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    if not head.strip():
        raise RecipeError(f"{label}: the file is empty; give a file with at least one example")
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl"):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if suffix == ".json" and text.lstrip()[:1] in ("[", "{"):
            try:
                json.loads(text)
                return
            except ValueError:
                if text.lstrip()[:1] == "[":  # one JSON document: the error's own line is the line
                    _raise_json_line(label, text, None)
        for number, line in enumerate(text.splitlines(), 1):  # JSON lines
            if line.strip():
                _raise_json_line(label, line, number)
    elif suffix == ".csv":
        lines = [line for line in head.decode("utf-8", "replace").splitlines() if line.strip()]
        if len(lines) < 2 and len(head) < (1 << 16):
            raise RecipeError(f"{label}: the CSV file has a header line and no rows; add one row per example")


def _raise_json_line(label: str, text: str, number: int | None) -> None:
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        line = number if number is not None else exc.lineno
        raise RecipeError(f"{label} line {line}: not valid JSON ({exc.msg}); fix or remove that line") from None
    if number is not None and not isinstance(value, dict):
        raise RecipeError(f"{label} line {number}: a JSON line must be an object ({{\"prompt\": ..., ...}}), not "
                          f"{type(value).__name__}")


def _tokenize_sft_row(row: dict[str, Any], tokenizer, d: DataSection) -> dict[str, list[int]]:
    from .. import tiny

    if d.messages_field in row and row[d.messages_field]:
        return tokenize_messages(row[d.messages_field], tokenizer, d.max_length)
    if d.prompt_field in row and d.response_field in row:
        pair = {"prompt": str(row[d.prompt_field]), "response": str(row[d.response_field])}
        return tiny.tokenize_sft(pair, tokenizer, d.max_length)
    raise RecipeError(
        f"data.dataset={d.dataset!r} has columns {sorted(row)}; an SFT row needs data.prompt_field and "
        f"data.response_field (now {d.prompt_field!r}, {d.response_field!r}) or chat messages in data.messages_field "
        f"(now {d.messages_field!r}). Set them to your column names, e.g. prompt_field=instruction response_field=output"
    )


def tokenize_messages(messages: list[dict[str, str]], tokenizer, max_length: int | None) -> dict[str, list[int]]:
    """A chat rendered with the tokenizer's template; the last (assistant) turn is the target, the rest is -100."""
    if not getattr(tokenizer, "chat_template", None):
        raise RecipeError("rows with chat messages need a tokenizer with a chat template; use prompt/response columns")
    if messages[-1].get("role") != "assistant":
        raise RecipeError(f"the last chat message must be the assistant's (the target), got {messages[-1].get('role')!r}")
    from ..tiny import chat_prompt_and_target

    try:
        prompt_ids, target_ids = chat_prompt_and_target(messages, tokenizer)
    except ValueError as exc:
        raise RecipeError(f"{exc} (data.prompt_field / data.response_field)") from None
    ids = (prompt_ids + target_ids)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + target_ids)[:max_length]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def _classification_rows(rows, d: DataSection, num_labels: int | None):
    missing = [f for f in (d.text_field, d.label_field) if f not in rows.column_names]
    if missing:
        raise RecipeError(
            f"data.dataset={d.dataset!r} has columns {rows.column_names}; set data.text_field and data.label_field "
            f"(now {d.text_field!r}, {d.label_field!r}) to the text and label columns"
        )
    labels = rows[d.label_field]
    names = getattr(rows.features[d.label_field], "names", None)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in labels):
        ids = labels
        num_labels = num_labels or (len(names) if names else max(ids) + 1)
    else:
        vocab = {v: i for i, v in enumerate(sorted({str(x) for x in labels}))}
        ids = [vocab[str(x)] for x in labels]
        num_labels = num_labels or len(vocab)
    return [{"text": t, "label": y} for t, y in zip(rows[d.text_field], ids)], num_labels

