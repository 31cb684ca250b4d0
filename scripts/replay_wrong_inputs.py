"""Replay of 40 wrong inputs as a new user makes them (issue 59, "Nothing silent, part 6"): `hf-accum train RECIPE
key=value`, `hf-accum probe`, and the Python API (AccumTrainer, AccumTrainingArguments, AccumSFTConfig).

Each input is run (CPU, the tiny model; the command line as a user runs it, in a subprocess) and judged:
  clear         refused (or, for an input that trains, said) in at most 2 lines naming the argument and the fix
  unclear       refused without naming what the case's words say a user needs, or in more than 2 lines
  traceback     a traceback (CLI), or an internal / chained exception (API)
  wrong result  an input that should be refused ran, or what should have been said was not

    HF_HUB_OFFLINE=1 PYTHONPATH=. python scripts/replay_wrong_inputs.py [--only N,N] [--keep DIR]

prints one table row per input (number, verdict, message lines, seconds, what it was) and the counts. It exits 1 when
an input gives a wrong result or a traceback, when more than 2 are unclear, or a message has more than 2 lines."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ERROR_LINE = re.compile(r"^(hf-accum( train| probe)?: |usage: |error: )")


@dataclass
class Case:
    what: str                       # what the user typed, as shown in the table
    run: list[str] | Callable       # CLI arguments after `hf-accum`, or a function raising what the API raises
    says: list[str]                 # words (regexes, case-insensitive) the answer must hold to be clear
    refused: bool = True            # False: the input trains, and `says` is what the run must tell
    setup: Callable | None = field(default=None, repr=False)


@dataclass
class Result:
    verdict: str
    lines: int
    seconds: float
    message: str


# ---- the command line --------------------------------------------------------------------------------------------
def cli(argv: list[str], cwd: str) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "hf_accum.cli", *argv], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)
    return done.returncode, done.stdout, done.stderr


def error_message(stderr: str) -> list[str]:
    """The refusal's lines: from the first line that opens an error (`hf-accum train: ...`, argparse's `usage:`) to
    the end; log lines printed before it (the run's progress) are not the message."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if ERROR_LINE.match(line):
            return lines[i:]
    return lines[-1:] if lines else []


def judge_cli(case: Case, cwd: str) -> Result:
    start = time.perf_counter()
    rc, out, err = cli(case.run, cwd)
    seconds = time.perf_counter() - start
    if "Traceback (most recent call last)" in err:
        return Result("traceback", len(err.splitlines()), seconds, err.strip().splitlines()[-1])
    if not case.refused:
        text = out + err
        missing = [w for w in case.says if not re.search(w, text, re.I | re.M)]
        if rc != 0:
            return Result("wrong result", 0, seconds, f"exit {rc}: {error_message(err)}")
        said = next((line for line in text.splitlines() if re.search(case.says[0], line, re.I)), "")
        return Result("wrong result" if missing else "clear", 1 if said else 0, seconds,
                      said or f"nothing says {missing}")
    if rc == 0:
        return Result("wrong result", 0, seconds, "trained (exit 0)")
    message = error_message(err)
    text = " ".join(message)
    missing = [w for w in case.says if not re.search(w, text, re.I)]
    verdict = "unclear" if missing or len(message) > 2 else "clear"
    return Result(verdict, len(message), seconds, text + (f"   [lacks: {missing}]" if missing else ""))


# ---- the Python API ----------------------------------------------------------------------------------------------
def judge_api(case: Case) -> Result:
    start = time.perf_counter()
    try:
        said = case.run()
    except Exception as error:  # noqa: BLE001 - what a user's script would see
        seconds = time.perf_counter() - start
        chained = (error.__cause__ is not None or (error.__context__ is not None and not error.__suppress_context__))
        message = str(error).strip().splitlines() or [""]
        text = f"{type(error).__name__}: {' '.join(message)}"
        ours = type(error).__module__.split(".")[0] in ("builtins", "hf_accum") and isinstance(error, (ValueError,
                                                                                                      TypeError))
        if not case.refused:
            return Result("wrong result", len(message), seconds, text)
        if chained or not ours:
            return Result("traceback", len(message), seconds, text + (" (chained)" if chained else ""))
        missing = [w for w in case.says if not re.search(w, text, re.I)]
        verdict = "unclear" if missing or len(message) > 2 else "clear"
        return Result(verdict, len(message), seconds, text + (f"   [lacks: {missing}]" if missing else ""))
    seconds = time.perf_counter() - start
    if case.refused:
        return Result("wrong result", 0, seconds, "accepted")
    said = said or ""
    missing = [w for w in case.says if not re.search(w, said, re.I | re.M)]
    line = next((line for line in said.splitlines() if re.search(case.says[0], line, re.I)), "")
    return Result("wrong result" if missing else "clear", 1 if line else 0, seconds,
                  line or f"nothing says {missing}")


def _args(**kw):
    from hf_accum import AccumTrainingArguments

    base = dict(output_dir=os.path.join(WORK, "api_out"), use_cpu=True, report_to=[], save_strategy="no",
                disable_tqdm=True)
    return AccumTrainingArguments(**{**base, **kw})


def _sft_config(**kw):
    from hf_accum.trl import AccumSFTConfig

    return AccumSFTConfig(output_dir=os.path.join(WORK, "api_out"), use_cpu=True, report_to=[], **kw)


def _rows(n=16, labels=True):
    import random

    g = random.Random(0)
    rows = []
    for _ in range(n):
        ids = [g.randint(3, 90) for _ in range(g.randint(6, 24))]
        cut = len(ids) // 2
        rows.append({"input_ids": ids, "labels": ([-100] * cut + ids[cut:]) if labels else [-100] * len(ids)})
    return rows


def _collate(rows):
    import torch

    width = max(len(r["input_ids"]) for r in rows)
    return {"input_ids": torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"]))
                                            for r in rows]),
            "labels": torch.tensor([r["labels"] + [-100] * (width - len(r["labels"])) for r in rows])}


def _lists_collate(rows):
    return {k: v.tolist() for k, v in _collate(rows).items()}


def _train(model=None, rows=None, collate=_collate, **kw):
    """An AccumTrainer on the tiny Llama, trained 1 step; returns what hf_accum logged at warning level."""
    import logging

    from hf_accum import AccumTrainer
    from hf_accum.tiny import build_model

    args = _args(**{"target_batch_size": 8, "memory_budget_bytes": 64 * 2**20, "max_steps": 1,
                    "remove_unused_columns": False, **kw})
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("hf_accum").addHandler(handler)
    try:
        trainer = AccumTrainer(model=model or build_model(), args=args,
                               train_dataset=_rows() if rows is None else rows, data_collator=collate)
        trainer.train()
    finally:
        logging.getLogger("hf_accum").removeHandler(handler)
    return "\n".join(lines)


def _bare_llama():
    import transformers

    from hf_accum.tiny import build_config

    return transformers.LlamaModel(build_config())


def _endless():
    import torch

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            while True:
                yield from _rows()

    return Stream()


def _grow_a_checkpoint(cwd):
    """A real run that saves checkpoint-1 and -2, then both optimizer.pt files cut short (as a kill mid-save)."""
    out = os.path.join(cwd, "resumable")
    if not os.path.isdir(out):
        rc, _, err = cli(["train", "lora_sft", "max_steps=2", "save_steps=1", "num_examples=64",
                          f"output_dir={out}"], cwd)
        assert rc == 0, err
    for step in (1, 2):
        path = os.path.join(out, f"checkpoint-{step}", "optimizer.pt")
        with open(path, "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)


def _long_rows_file(cwd):
    """A data file where half the rows' prompts are longer than max_length=32 (no target token left)."""
    import json

    with open(os.path.join(cwd, "long.jsonl"), "w") as f:
        for i in range(64):
            prompt = "word " * (60 if i % 2 else 3)
            f.write(json.dumps({"prompt": prompt + f"row {i}", "response": "yes"}) + "\n")


def _bad_jsonl(cwd):
    with open(os.path.join(cwd, "bad.jsonl"), "w") as f:
        f.write('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": \n')


WORK = tempfile.mkdtemp(prefix="replay_")
OUT = "output_dir=out"
SFT = ["train", "lora_sft"]

CASES = [
    # --- the inputs (items 1-12, 18) ----------------------------------------------------------------------
    Case("train lora_sft training.max_length=-3", [*SFT, "training.max_length=-3"], ["max_length", "positive"]),
    Case("API: SFTCollator-like collator returning lists", lambda: _train(collate=_lists_collate),
         ["data_collator", "tensor"]),
    Case("API: bare LlamaModel (no head)", lambda: _train(model=_bare_llama()),
         ["no head", "AutoModelForCausalLM"]),
    Case("train lora_sft --max_steps=5", [*SFT, "--max_steps=5"], ["max_steps=5"]),
    Case("train lora_sft max_length=-3", [*SFT, "max_length=-3"], ["max_length=-3", "positive"]),
    Case("train lora_sft lora.lora_dropout=2", [*SFT, "lora.lora_dropout=2"], ["lora.lora_dropout", r"\[0, 1\)"]),
    Case("probe --estimate --device cuda --device-memory 80", ["probe", "--estimate", "--device", "cuda",
                                                               "--device-memory", "80"], ["80GiB"]),
    Case("train lora_sft memory_budget_bytes=200000 (nothing fits)", [*SFT, "memory_budget_bytes=200000", OUT],
         ["memory_budget_bytes"]),
    Case("train lora_sft: half the rows longer than max_length", [*SFT, "data.dataset=long.jsonl",
                                                                  "training.max_length=32", "max_steps=1", OUT],
         ["were dropped", "max_length"], refused=False, setup=_long_rows_file),
    Case("API: gradient_checkpointing=False, checkpoint_layers=1",
         lambda: _args(gradient_checkpointing=False, checkpoint_layers=1), ["checkpoint_layers", "gradient_check"]),
    Case("API: IterableDataset with no length", lambda: _train(rows=_endless()), ["probe_seq_len"]),
    Case("train lora_sft resume_from_checkpoint=true (only checkpoints cut short)",
         [*SFT, "resume_from_checkpoint=true", "output_dir=resumable"], ["optimizer.pt", "output_dir="],
         setup=_grow_a_checkpoint),
    Case("probe --estimate --model tiny", ["probe", "--estimate", "--model", "tiny"],
         ["^plan: micro", "fake tensors"], refused=False),
    Case("API: a probe at transformers' default verbosity (silent before)", lambda: _train(),
         [r"micro-batch \d+: peak .*, fits", "searching the largest micro-batch", "hf_accum plan: micro"],
         refused=False),
    # --- the manual's pointers (item 13) and 26 more of a new user's mistakes ---------------------------------
    Case("train no_such_recipe", ["train", "no_such_recipe"], ["no_such_recipe", "lora_sft"]),
    Case("train lora_sft resume_from_checkpoint=resumable/checkpoint-2 (cut short)",
         [*SFT, "resume_from_checkpoint=resumable/checkpoint-2", "output_dir=resumable"], ["optimizer.pt"]),
    Case("train lora_sft lerning_rate=1e-4 (typo)", [*SFT, "lerning_rate=1e-4"], ["learning_rate"]),
    Case("train lora_sft learning_rate=abc", [*SFT, "learning_rate=abc"], ["learning_rate", "number"]),
    Case("train lora_sft target_batch_size=0", [*SFT, "target_batch_size=0"], ["target_batch_size", "positive"]),
    Case("train lora_sft beta=0.1 (a DPO key)", [*SFT, "beta=0.1"], ["beta", "dpo"]),
    Case("train lora_sft model=./no_such_model", [*SFT, "model=./no_such_model"], ["no such directory"]),
    Case("train lora_sft data.dataset=missing.jsonl", [*SFT, "data.dataset=missing.jsonl"], ["missing.jsonl"]),
    Case("train lora_sft data.dataset=bad.jsonl (malformed line 2)", [*SFT, "data.dataset=bad.jsonl"],
         ["bad.jsonl", "line 2"], setup=_bad_jsonl),
    Case("train lora_sft output_dir=/proc/nope", [*SFT, "output_dir=/proc/nope"], ["output_dir", "cannot be written"]),
    Case("train lora_sft num_train_epochs=0", [*SFT, "num_train_epochs=0", "max_steps=-1"], ["num_train_epochs"]),
    Case("train lora_sft checkpoint_layers=99", [*SFT, "checkpoint_layers=99", OUT], ["checkpoint_layers"]),
    Case("train lora_sft eval_strategy=steps (nothing held out)", [*SFT, "eval_strategy=steps"],
         ["eval_examples"]),
    Case("train lora_sft lora.target_modules=[nope]", [*SFT, "lora.target_modules=[nope]", OUT],
         ["target_modules", "q_proj"]),
    Case("train lora_sft memory_budget=1.5", [*SFT, "memory_budget=1.5"], ["memory_budget", r"\(0, 1\]"]),
    Case("train lora_sft max_steps (no value)", [*SFT, "max_steps"], ["max_steps=", "key=value"]),
    Case("train (no recipe)", ["train"], [r"required: recipe \("]),  # not "recipe, key=value": overrides are optional
    Case("probe --budget 2", ["probe", "--budget", "2"], ["--budget", r"\(0, 1\]"]),
    Case("probe --seq-len abc", ["probe", "--seq-len", "abc"], ["--seq-len"]),
    Case("probe --model ./no_such_model", ["probe", "--model", "./no_such_model"], ["no_such_model"]),
    Case("API: AccumTrainingArguments(memory_budget=1.5)", lambda: _args(memory_budget=1.5),
         ["memory_budget", r"\(0, 1\]"]),
    Case("API: auto_find_batch_size=True with a target", lambda: _args(auto_find_batch_size=True,
                                                                        target_batch_size=8),
         ["auto_find_batch_size"]),
    Case("API: target 8 with micro 3 x accumulation 2", lambda: _args(target_batch_size=8,
                                                                      per_device_train_batch_size=3,
                                                                      gradient_accumulation_steps=2, auto_tune=False),
         ["target_batch_size", "gradient_accumulation_steps|per_device_train_batch_size"]),
    Case("API: AccumSFTConfig(max_length=-3)", lambda: _sft_config(max_length=-3), ["max_length", "positive"]),
    Case("API: AccumTrainer, every label -100", lambda: _train(rows=_rows(labels=False)), ["label"]),
    Case("API: AccumTrainer, target 64 > 16 rows", lambda: _train(target_batch_size=64), ["target_batch_size",
                                                                                          "16"]),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma list of case numbers (from 1)")
    parser.add_argument("--keep", help="folder to run in (kept); default a temporary one, removed")
    options = parser.parse_args(argv)
    global WORK
    if options.keep:
        WORK = os.path.abspath(options.keep)
        os.makedirs(WORK, exist_ok=True)
    chosen = range(1, len(CASES) + 1) if not options.only else [int(n) for n in options.only.split(",")]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    counts: dict[str, int] = {}
    too_long = 0
    print(f"{'#':>2}  {'verdict':<12} {'lines':>5} {'s':>5}  input -> message")
    for n in chosen:
        case = CASES[n - 1]
        if case.setup:
            case.setup(WORK)
        shutil.rmtree(os.path.join(WORK, "out"), ignore_errors=True)
        result = judge_cli(case, WORK) if isinstance(case.run, list) else judge_api(case)
        counts[result.verdict] = counts.get(result.verdict, 0) + 1
        too_long += result.lines > 2
        message = result.message if len(result.message) <= 220 else result.message[:217] + "..."
        print(f"{n:>2}  {result.verdict:<12} {result.lines:>5} {result.seconds:>5.1f}  {case.what}\n"
              f"{'':>29}-> {message}", flush=True)
    print("\n" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + f"; messages over 2 lines: {too_long}")
    if not options.keep:
        shutil.rmtree(WORK, ignore_errors=True)
    bad = counts.get("wrong result", 0) + counts.get("traceback", 0) + too_long
    return 1 if bad or counts.get("unclear", 0) > 2 else 0


if __name__ == "__main__":
    sys.exit(main())
