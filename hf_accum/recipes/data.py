"""Step 3 of a recipe: the data. Rows (generated tiny data, a local file or a hub dataset) tokenized into training
examples, the collator, and per-example token statistics."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..probing.loading import hub_unreachable
from .config import DATA_FILE_BUILDERS, Recipe, RecipeError
from .sections import DataSection


@dataclass
class RecipeData:
    dataset: Any
    collator: Any
    num_labels: int | None
    mean_tokens: float
    mean_targets: float
    longest: int
    eval_dataset: Any = None


def build_data(recipe: Recipe, tokenizer) -> RecipeData:
    """The training rows and how they are batched. seq_cls: tokenized examples (a list-backed torch Dataset),
    transformers' `DataCollatorWithPadding` and the token statistics. causal_lm and dpo: rows in TRL's formats (a
    `datasets.Dataset`), which the TRL trainer tokenizes and collates; :func:`sft_stats` / :func:`preference_stats`
    count the tokens after that."""
    d, task = recipe.data, recipe.model.task
    if task == "grpo":
        return _held_out(_grpo_data(d, tokenizer), d)
    if task == "dpo":
        return _held_out(_preference_data(d, tokenizer), d)
    if task == "causal_lm":
        return _held_out(_sft_data(d, tokenizer), d)
    from transformers import DataCollatorWithPadding

    from .. import tiny

    num_labels = recipe.model.num_labels
    if d.dataset == "tiny":
        dataset = tiny.build_classification_dataset(d.num_examples or 2000, tokenizer, max_length=d.max_length,
                                                    seed=d.seed)
        num_labels = num_labels or 2
    else:
        rows, num_labels = _classification_rows(_load_rows(d), d, num_labels)
        dataset = tiny.ListDataset([tiny.tokenize_classification(r, tokenizer, d.max_length) for r in rows])
    if len(dataset) == 0:
        raise RecipeError(f"data.dataset={d.dataset!r} gave no training example")
    data = _held_out(RecipeData(dataset, DataCollatorWithPadding(tokenizer), num_labels, 0.0, 1.0, 0), d)
    lengths = [len(r["input_ids"]) for r in data.dataset.rows]
    return replace(data, mean_tokens=sum(lengths) / len(lengths), longest=max(lengths))


def _held_out(data: RecipeData, d: DataSection) -> RecipeData:
    """The last ``data.eval_examples`` rows become the evaluation set; the rest train."""
    n, held = len(data.dataset), d.eval_examples
    if not held:
        return data
    if held >= n:
        raise RecipeError(f"data.eval_examples={held} leaves no training row of the {n} rows: hold out fewer (e.g. "
                          f"data.eval_examples={max(1, n // 10)})")
    if hasattr(data.dataset, "select"):  # a datasets.Dataset
        train, evaluation = data.dataset.select(range(n - held)), data.dataset.select(range(n - held, n))
    else:
        rows = data.dataset.rows
        train, evaluation = type(data.dataset)(rows[:n - held]), type(data.dataset)(rows[n - held:])
    return replace(data, dataset=train, eval_dataset=evaluation)


def _sft_data(d: DataSection, tokenizer) -> RecipeData:
    """SFT rows as TRL prompt-completion rows: conversational (TRL applies the chat template) where the tokenizer
    has one, else plain text; TRL's completion-only loss then trains on the response alone."""
    from datasets import Dataset

    from .. import tiny

    if d.dataset == "tiny":
        pairs = tiny.generate_instruction_data(d.num_examples or 2000, seed=d.seed, long_tailed=True)
        rows = [_prompt_completion(p["prompt"], p["response"], tokenizer) for p in pairs]
    else:
        rows = [_sft_row(r, tokenizer, d, i) for i, r in enumerate(_load_rows(d))]
    return RecipeData(Dataset.from_list(rows), None, None, 0.0, 0.0, 0)


def _prompt_completion(prompt: str, response: str, tokenizer) -> dict[str, Any]:
    if getattr(tokenizer, "chat_template", None):
        return {"prompt": [{"role": "user", "content": prompt}], "completion": [{"role": "assistant", "content": response}]}
    return {"prompt": prompt + "\n", "completion": response}  # TRL adds the eos token to a text completion


def sft_stats(data: RecipeData, tokenized) -> RecipeData:
    """Token statistics of the rows as the SFT trainer tokenized them (input_ids, and labels that are -100 on the
    prompt: TRL's completion-only loss); the first position is never predicted (causal shift)."""
    lengths = [len(ids) for ids in tokenized["input_ids"]]
    if "labels" in tokenized.column_names:  # TRL builds the labels column while preparing the dataset
        targets = [sum(x != -100 for x in labels[1:]) for labels in tokenized["labels"]]
    else:  # TRL versions that mask in the collator keep the completion mask instead
        targets = [sum(mask[1:]) for mask in tokenized["completion_mask"]]
    if not any(targets):
        raise RecipeError("no SFT example has a target token after truncation: raise training.max_length")
    return replace(data, dataset=tokenized, mean_tokens=sum(lengths) / len(lengths),
                   mean_targets=sum(targets) / len(targets), longest=max(lengths))


def _preference_data(d: DataSection, tokenizer) -> RecipeData:
    """Preference pairs as TRL reads them ({prompt, chosen, rejected}: strings or chat messages). `AccumDPOTrainer`
    applies the chat template, tokenizes and collates them; :func:`preference_stats` counts the tokens after that."""
    from datasets import Dataset

    from .. import tiny

    if d.dataset == "tiny":
        dataset = Dataset.from_list(tiny.generate_preference_data(d.num_examples or 2000, seed=d.seed))
    else:
        rows = _load_rows(d)
        fields = {d.prompt_field: "prompt", d.chosen_field: "chosen", d.rejected_field: "rejected"}
        missing = [f for f in fields if f not in rows.column_names]
        if missing:
            raise RecipeError(
                f"data.dataset={d.dataset!r} has columns {rows.column_names}; a preference row needs "
                f"data.prompt_field, data.chosen_field and data.rejected_field (now {d.prompt_field!r}, "
                f"{d.chosen_field!r}, {d.rejected_field!r}): set them to your column names"
            )
        for field, what in ((d.chosen_field, "chosen response"), (d.rejected_field, "rejected response")):
            index = next((i for i, value in enumerate(rows[field]) if _empty_turns(value)), None)
            if index is not None:
                _refuse_empty(d, index, what, f"data.{'chosen' if field == d.chosen_field else 'rejected'}_field="
                              f"{field!r}")
        dataset = rows.select_columns(list(fields)).rename_columns({k: v for k, v in fields.items() if k != v})
    return RecipeData(dataset, None, None, 0.0, 1.0, 0)


def _grpo_data(d: DataSection, tokenizer) -> RecipeData:
    """Prompts and answers as TRL's GRPOTrainer reads them ({prompt, answer}; the prompt in chat form where the
    tokenizer has a template, which TRL applies); the answer column reaches the rewards. Token counts: `grpo_stats`."""
    from datasets import Dataset

    from .. import tiny

    if d.dataset == "tiny":
        rows = tiny.generate_arithmetic_prompts(d.num_examples or 2000, seed=d.seed)
    else:
        loaded = _load_rows(d)
        missing = [f for f in (d.prompt_field, d.answer_field) if f not in loaded.column_names]
        if missing:
            raise RecipeError(f"data.dataset={d.dataset!r} has columns {loaded.column_names}; a grpo row needs "
                              f"data.prompt_field and data.answer_field (now {d.prompt_field!r}, {d.answer_field!r}): "
                              "set them to your column names")
        rows = [{"prompt": r[d.prompt_field], "answer": str(r[d.answer_field])} for r in loaded]
    chat = bool(getattr(tokenizer, "chat_template", None))
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}] if chat and isinstance(r["prompt"], str)
             else r["prompt"], "answer": r["answer"]} for r in rows]
    return RecipeData(Dataset.from_list(rows), None, None, 0.0, 1.0, 0)


def grpo_stats(data: RecipeData, prompt_lengths: list[int], max_completion: int) -> RecipeData:
    """Tokens per completion row: its prompt (as TRL tokenizes it) + at most max_completion_length; the target is the
    completion."""
    mean = sum(prompt_lengths) / len(prompt_lengths)
    return replace(data, mean_tokens=mean + max_completion, mean_targets=1.0, longest=max(prompt_lengths) + max_completion)


def preference_stats(data: RecipeData, tokenized) -> RecipeData:
    """Token statistics of the pairs as the DPO trainer tokenized them (prompt_ids, chosen_ids, rejected_ids):
    tokens per pair counts both sequences (the prompt twice, as they are forwarded); the target is the pair."""
    lengths = [2 * len(p) + len(c) + len(r)
               for p, c, r in zip(tokenized["prompt_ids"], tokenized["chosen_ids"], tokenized["rejected_ids"])]
    longest = max(len(p) + max(len(c), len(r))
                  for p, c, r in zip(tokenized["prompt_ids"], tokenized["chosen_ids"], tokenized["rejected_ids"]))
    return replace(data, dataset=tokenized, mean_tokens=sum(lengths) / len(lengths), mean_targets=1.0, longest=longest)


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


def _refuse_empty(d: DataSection, index: int, what: str, field: str) -> None:
    raise RecipeError(
        f"data.dataset={d.dataset!r} row {index} (counting from 0) has an empty {what} ({field}): there is nothing "
        "in it to train on; fill in or remove that row"
    )


def _empty(text: Any) -> bool:
    return not str(text if text is not None else "").strip()


def _sft_row(row: dict[str, Any], tokenizer, d: DataSection, index: int = 0) -> dict[str, Any]:
    if d.messages_field in row and row[d.messages_field]:
        messages = row[d.messages_field]
        if not getattr(tokenizer, "chat_template", None):
            raise RecipeError("rows with chat messages need a tokenizer with a chat template; use prompt/response "
                              "columns (data.prompt_field, data.response_field)")
        if messages[-1].get("role") != "assistant":
            raise RecipeError(f"the last chat message must be the assistant's (the target), got "
                              f"{messages[-1].get('role')!r}")
        if _empty(messages[-1].get("content")):
            _refuse_empty(d, index, "assistant turn", f"the last message of data.messages_field={d.messages_field!r}")
        return {"prompt": messages[:-1], "completion": messages[-1:]}
    if row.get(d.prompt_field) is not None and row.get(d.response_field) is not None:
        if _empty(row[d.response_field]):
            _refuse_empty(d, index, "response", f"data.response_field={d.response_field!r}")
        return _prompt_completion(str(row[d.prompt_field]), str(row[d.response_field]), tokenizer)
    raise RecipeError(
        f"data.dataset={d.dataset!r} has columns {sorted(row)}; an SFT row needs data.prompt_field and "
        f"data.response_field (now {d.prompt_field!r}, {d.response_field!r}) or chat messages in data.messages_field "
        f"(now {d.messages_field!r}). Set them to your column names, e.g. prompt_field=instruction response_field=output"
    )


def _empty_turns(value: Any) -> bool:
    """An empty string, or chat turns without content."""
    if isinstance(value, list):
        return all(_empty(turn.get("content") if isinstance(turn, dict) else turn) for turn in value)
    return _empty(value)


def _classification_rows(rows, d: DataSection, num_labels: int | None):
    missing = [f for f in (d.text_field, d.label_field) if f not in rows.column_names]
    if missing:
        raise RecipeError(
            f"data.dataset={d.dataset!r} has columns {rows.column_names}; set data.text_field and data.label_field "
            f"(now {d.text_field!r}, {d.label_field!r}) to the text and label columns"
        )
    index = next((i for i, text in enumerate(rows[d.text_field]) if _empty(text)), None)
    if index is not None:
        _refuse_empty(d, index, "text", f"data.text_field={d.text_field!r}")
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

