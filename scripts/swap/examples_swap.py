"""Run transformers' own example scripts run_summarization.py and run_translation.py plain and with
`AccumSeq2SeqTrainer` / `AccumSeq2SeqTrainingArguments` swapped in by two names, offline, and compare them.

    python scripts/swap/examples_swap.py TRANSFORMERS_DIR [--scripts summarization,translation] [--steps 12]
                                         [--jobs 2] [--work DIR] [--keep]
    python scripts/swap/examples_swap.py TRANSFORMERS_DIR --extract GIT_DIR COMMIT   # fill TRANSFORMERS_DIR

TRANSFORMERS_DIR is a checkout or extract of transformers holding examples/pytorch/summarization/run_summarization.py
and examples/pytorch/translation/run_translation.py. The scripts are not ours: they are read from there, swapped in a
temporary copy, and never copied into this repository (a TRANSFORMERS_DIR inside it is refused).

"Swapped" is what a user does: `Seq2SeqTrainer` -> `AccumSeq2SeqTrainer` and `Seq2SeqTrainingArguments` ->
`AccumSeq2SeqTrainingArguments` (the two names leave transformers' import for one `from hf_accum import` line). Each
script runs train, evaluate with generation (`--predict_with_generate`) and predict on a tiny model built from config
(BART for summarization, T5 for translation) with its offline tokenizer (`hf_accum.tiny`'s BPE over characters,
a `PreTrainedTokenizerFast`) saved beside it, and local JSON data, four ways:

- plain 4x4: `Seq2SeqTrainer`, `--per_device_train_batch_size 4 --gradient_accumulation_steps 4`;
- plain 16x1: `Seq2SeqTrainer`, one batch of 16: the exact loss of the same 16 samples, the reference;
- ours 4x4: swapped, the plain flags (no target);
- ours target 16: swapped, the plain flags and `--target_batch_size 16` (the probe and the planner run).

BART and T5 ignore `num_items_in_batch`, so plain 4x4 logs and steps with the sum of the four micro-batch means (about
4x the loss; docs/exactness.md, "The 4x case"); ours must log plain 16x1's losses (train per step, eval) to float32
noise (relative 1e-4) and write a prediction per test row. The hub's metrics are replaced, in every run alike, by
local stand-ins on PYTHONPATH (`evaluate.load("rouge")`, `evaluate.load("sacrebleu")` and `nltk`, whose punkt data
is a download): the table says which. Prints a table; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4  # relative: float32 sums in another order and other padding (micro-batches of 4 vs one of 16)
SCRIPTS = {"summarization": "examples/pytorch/summarization/run_summarization.py",
           "translation": "examples/pytorch/translation/run_translation.py"}
RUNS = {  # run -> (swapped?, flags)
    "plain 4x4": (False, ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4"]),
    "plain 16x1": (False, ["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1"]),
    "ours 4x4": (True, ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4"]),
    "ours target 16": (True, ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4",
                              "--target_batch_size", "16"]),
}
REFERENCE = "plain 16x1"
REPLACED = ("offline stand-ins, the same in every run: `evaluate.load(\"rouge\")` -> ROUGE-1/2/L F1 averaged over "
            "pairs (lower-cased alphanumeric words, no stemmer); `evaluate.load(\"sacrebleu\")` -> corpus BLEU-4 on "
            "whitespace words, no smoothing; `nltk` -> `sent_tokenize` splits after . ! ?, no punkt download")
N_TRAIN, N_EVAL, N_TEST = 64, 8, 8


def swapped_source(text: str) -> str:
    """The script with hf_accum's two classes for transformers': each substitution must apply exactly once, so a
    changed upstream script fails here, not silently."""
    subs = [("    Seq2SeqTrainer,\n    Seq2SeqTrainingArguments,\n", ""),
            ("\nfrom transformers.utils import check_min_version\n",
             "\nfrom hf_accum import AccumSeq2SeqTrainer, AccumSeq2SeqTrainingArguments\n"
             "from transformers.utils import check_min_version\n"),
            ("DataTrainingArguments, Seq2SeqTrainingArguments))",
             "DataTrainingArguments, AccumSeq2SeqTrainingArguments))"),
            ("trainer = Seq2SeqTrainer(", "trainer = AccumSeq2SeqTrainer(")]
    for old, new in subs:
        if text.count(old) != 1:
            raise SystemExit(f"examples_swap: {old.strip()!r} occurs {text.count(old)} times in the script "
                             "(expected once): the example changed; update the substitution")
        text = text.replace(old, new)
    return text


# The stand-ins for what needs the hub, written as modules onto the runs' PYTHONPATH (plain and ours alike).
EVALUATE_SHIM = '''"""Offline stand-in for `evaluate` (examples_swap.py): load("rouge") and load("sacrebleu") only."""
import collections
import math
import re


def _words(text):
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def _f1(overlap, n_pred, n_ref):
    if not overlap:
        return 0.0
    p, r = overlap / n_pred, overlap / n_ref
    return 2 * p * r / (p + r)


def _ngrams(words, n):
    return collections.Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))


def _lcs(a, b):
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], prev + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


class Rouge:
    def compute(self, predictions, references, **_):
        out = collections.defaultdict(float)
        for pred, ref in zip(predictions, references):
            p, r = _words(pred), _words(ref)
            for n in (1, 2):
                a, b = _ngrams(p, n), _ngrams(r, n)
                out[f"rouge{n}"] += _f1(sum((a & b).values()), sum(a.values()), sum(b.values()))
            out["rougeL"] += _f1(_lcs(p, r), len(p), len(r))
        return {k: v / max(len(predictions), 1) for k, v in out.items()}


class SacreBleu:
    def compute(self, predictions, references, **_):
        matched, total, pred_len, ref_len = [0] * 4, [0] * 4, 0, 0
        for pred, refs in zip(predictions, references):
            p, r = pred.split(), refs[0].split()
            pred_len, ref_len = pred_len + len(p), ref_len + len(r)
            for n in range(4):
                a, b = _ngrams(p, n + 1), _ngrams(r, n + 1)
                matched[n] += sum((a & b).values())
                total[n] += sum(a.values())
        if not pred_len or not all(matched):
            return {"score": 0.0}
        log_precision = sum(math.log(m / t) for m, t in zip(matched, total)) / 4
        brevity = min(0.0, 1 - ref_len / pred_len)
        return {"score": 100 * math.exp(log_precision + brevity)}


def load(name, *args, **kwargs):
    metrics = {"rouge": Rouge, "sacrebleu": SacreBleu}
    if name not in metrics:
        raise ValueError(f"offline stand-in: no metric {name!r}")
    return metrics[name]()
'''
NLTK_SHIM = '''"""Offline stand-in for `nltk` (examples_swap.py): no punkt data to find; sentences end at . ! ?"""
import re
import types

data = types.SimpleNamespace(find=lambda *args, **kwargs: None)


def sent_tokenize(text):
    return [s for s in re.split(r"(?<=[.!?])\\s+", text) if s]


def download(*args, **kwargs):
    raise LookupError("offline stand-in: nltk.download is not available")
'''


def extract(git_dir: str, commit: str, dest: Path) -> None:
    """The two example scripts of COMMIT, via `git archive` (no work tree needed)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as tar:
        subprocess.run(["git", f"--git-dir={git_dir}", "archive", commit, *SCRIPTS.values()], stdout=tar, check=True)
        tar.seek(0)
        with tarfile.open(fileobj=tar) as archive:
            archive.extractall(dest, filter="data")
    sha = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", commit], capture_output=True, text=True,
                         check=True).stdout.strip()
    (dest / "SOURCE.txt").write_text(f"git dir {git_dir}\ncommit {sha}\n")
    print(f"extracted {', '.join(SCRIPTS.values())} of {sha} into {dest}")


def prepare(work: Path) -> dict[str, Path]:
    """The tiny BART and T5 (dropout 0, so one batch and four micro-batches see the same model) with the tokenizer
    saved beside each, the JSON data files, and the stand-in modules."""
    sys.path.insert(0, str(REPO))
    import torch
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    from hf_accum import tiny

    tok = tiny.build_tokenizer()
    ids = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}
    configs = {
        "bart": (BartForConditionalGeneration, BartConfig(
            vocab_size=len(tok), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
            bos_token_id=tok.bos_token_id, decoder_start_token_id=tok.bos_token_id, forced_eos_token_id=None,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, **ids)),
        "t5": (T5ForConditionalGeneration, T5Config(
            vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            decoder_start_token_id=tok.pad_token_id, dropout_rate=0.0, **ids)),
    }
    paths = {}
    for name, (cls, config) in configs.items():
        torch.manual_seed(0)
        paths[name] = work / f"tiny-{name}"
        cls(config).save_pretrained(paths[name])
        tok.save_pretrained(paths[name])
    rows = tiny.generate_instruction_data(N_TRAIN + N_EVAL + N_TEST, seed=5)
    splits = {"train": rows[:N_TRAIN], "validation": rows[N_TRAIN:N_TRAIN + N_EVAL],
              "test": rows[N_TRAIN + N_EVAL:]}
    for task, record in (("summarization", lambda r: {"document": r["prompt"], "summary": r["response"]}),
                         ("translation", lambda r: {"translation": {"en": r["prompt"], "ro": r["response"]}})):
        folder = work / f"data-{task}"
        folder.mkdir()
        for split, part in splits.items():
            with open(folder / f"{split}.json", "w") as f:
                f.writelines(json.dumps(record(r)) + "\n" for r in part)
        paths[f"data-{task}"] = folder
    shims = work / "shims"
    for module, text in (("evaluate", EVALUATE_SHIM), ("nltk", NLTK_SHIM)):
        (shims / module).mkdir(parents=True)
        (shims / module / "__init__.py").write_text(text)
    paths["shims"] = shims
    return paths


def script_copies(transformers_dir: Path, work: Path, names: list[str]) -> dict[tuple[str, bool], Path]:
    """(script, swapped) -> a copy of the example (swapped: substituted)."""
    out = {}
    for name in names:
        text = (transformers_dir / SCRIPTS[name]).read_text()
        for swapped, source in ((False, text), (True, swapped_source(text))):
            path = work / f"{'swapped' if swapped else 'plain'}_{Path(SCRIPTS[name]).name}"
            path.write_text(source)
            out[name, swapped] = path
    return out


def flags_for(name: str, paths: dict[str, Path], steps: int) -> list[str]:
    data = paths[f"data-{name}"]
    task = (["--model_name_or_path", str(paths["bart"]), "--text_column", "document", "--summary_column", "summary"]
            if name == "summarization" else
            ["--model_name_or_path", str(paths["t5"]), "--source_lang", "en", "--target_lang", "ro",
             "--source_prefix", "translate English to Romanian: "])
    return [*task, "--train_file", str(data / "train.json"), "--validation_file", str(data / "validation.json"),
            "--test_file", str(data / "test.json"), "--do_train", "--do_eval", "--do_predict",
            "--predict_with_generate", "--max_source_length", "64", "--max_target_length", "32",
            "--val_max_target_length", "32", "--per_device_eval_batch_size", str(N_EVAL), "--max_steps", str(steps),
            "--learning_rate", "5e-3", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
            "--use_cpu", "--seed", "0", "--disable_tqdm", "True", "--dataloader_num_workers", "0"]


def run_one(script: Path, flags: list[str], out: Path, paths: dict[str, Path], timeout: int) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", WANDB_DISABLED="true", HF_DATASETS_CACHE=str(out) + "-cache",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([str(paths["shims"]), str(REPO), os.environ.get("PYTHONPATH", "")])
               .rstrip(os.pathsep))
    log = out.with_suffix(".log")
    start = time.time()
    try:
        with open(log, "w") as f:
            rc = subprocess.run([sys.executable, str(script), *flags, "--output_dir", str(out)], stdout=f,
                                stderr=subprocess.STDOUT, env=env, cwd=out.parent, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    results = json.loads((out / "all_results.json").read_text()) if (out / "all_results.json").exists() else {}
    state = out / "trainer_state.json"
    history = json.loads(state.read_text())["log_history"] if state.exists() else []
    predictions = out / "generated_predictions.txt"
    return {"rc": rc, "seconds": time.time() - start, "log": str(log), "results": results,
            "losses": [h["loss"] for h in history if "loss" in h and "step" in h],
            "predictions": predictions.read_text().split("\n") if predictions.exists() else None}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def check(runs: dict[str, dict]) -> dict[str, dict]:
    """Per run of ours: the largest relative difference of its train losses (per step) and eval loss from the
    reference's, whether its predictions are the reference's, and the verdict."""
    ref = runs[REFERENCE]
    out = {}
    for name, run in runs.items():
        ok = run["rc"] == 0 and run["predictions"] is not None and len(run["predictions"]) == N_TEST
        entry = {"ok": ok, "diff": None, "same_predictions": run["predictions"] == ref["predictions"]}
        if RUNS[name][0]:
            pairs = list(zip(run["losses"], ref["losses"]))
            if ok and ref["losses"] and len(run["losses"]) == len(ref["losses"]) and "eval_loss" in run["results"]:
                pairs.append((run["results"]["eval_loss"], ref["results"]["eval_loss"]))
                entry["diff"] = max(rel(a, b) for a, b in pairs)
            entry["ok"] = ok and entry["diff"] is not None and entry["diff"] <= TOLERANCE
        out[name] = entry
    return out


def run_scripts(transformers_dir: Path, names: list[str], work: Path, steps: int = 12, timeout: int = 900,
                jobs: int = 2) -> dict[str, dict[str, dict]]:
    """Every script in every run of RUNS, ``jobs`` at a time (each is mostly imports)."""
    from concurrent.futures import ThreadPoolExecutor

    paths = prepare(work)
    scripts = script_copies(transformers_dir, work, names)
    futures = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for name in names:
            for run, (swapped, extra) in RUNS.items():
                out = work / f"out-{name}-{run.replace(' ', '-')}"
                futures[name, run] = pool.submit(run_one, scripts[name, swapped],
                                                 [*flags_for(name, paths, steps), *extra], out, paths, timeout)
    return {name: {run: futures[name, run].result() for run in RUNS} for name in names}


def fmt(results: dict, key: str) -> str:
    return f"{results[key]:.4f}" if key in results else "-"


def table(results: dict[str, dict[str, dict]]) -> str:
    head = ("| script | run | exit | logged loss, first ... last step | train_loss | eval_loss | eval metric | "
            "predictions (non-empty) | max rel diff vs plain 16x1 | seconds |\n|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name, runs in results.items():
        checks = check(runs)
        metric = "eval_rouge1" if name == "summarization" else "eval_bleu"
        for run, r in runs.items():
            res, c = r["results"], checks[run]
            preds = r["predictions"]
            count = "-" if preds is None else f"{len(preds)} ({sum(bool(p.strip()) for p in preds)})"
            if preds is not None and run != REFERENCE:
                count += ", the same" if c["same_predictions"] else ", other text"
            diff = "(reference)" if run == REFERENCE else ("-" if c["diff"] is None else f"{c['diff']:.1e}")
            if RUNS[run][0]:
                diff += " ok" if c["ok"] else " FAIL"
            elif run != REFERENCE and r["losses"] and runs[REFERENCE]["losses"]:
                diff = f"first step {r['losses'][0] / runs[REFERENCE]['losses'][0]:.2f}x"

            losses = " ... ".join(f"{x:.4f}" for x in r["losses"][:1] + r["losses"][-1:]) or "-"
            rows.append(f"| {Path(SCRIPTS[name]).name} | {run} | {r['rc']} | {losses} | {fmt(res, 'train_loss')} | "
                        f"{fmt(res, 'eval_loss')} | {metric.split('_')[1]} {fmt(res, metric)}, gen_len "
                        f"{fmt(res, 'eval_gen_len')} | {count} | {diff} | {r['seconds']:.0f} |")
    return "\n".join([head, *rows, "", f"Metrics: {REPLACED}."])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("transformers_dir", type=Path)
    parser.add_argument("--extract", nargs=2, metavar=("GIT_DIR", "COMMIT"))
    parser.add_argument("--scripts", default=",".join(SCRIPTS), help=f"comma-separated, of {', '.join(SCRIPTS)}")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run (default 12: enough for the "
                        "tiny models to generate more than special tokens)")
    parser.add_argument("--work", help="folder for models, data, runs and logs (default: a temp folder, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per script run")
    parser.add_argument("--jobs", type=int, default=2, help="script runs at a time (default 2)")
    opts = parser.parse_args(argv)
    source = opts.transformers_dir.resolve()
    if source == REPO or REPO in source.parents:
        parser.error(f"{source} is inside this repository; transformers' scripts must stay outside it.")
    if opts.extract:
        extract(*opts.extract, source)
        return 0
    names = [n for n in opts.scripts.split(",") if n]
    unknown = sorted(set(names) - set(SCRIPTS))
    if unknown:
        parser.error(f"--scripts: unknown {unknown}; choose from {', '.join(SCRIPTS)}")
    missing = [SCRIPTS[n] for n in names if not (source / SCRIPTS[n]).exists()]
    if missing:
        parser.error(f"{source} lacks {', '.join(missing)}; fill it with --extract GIT_DIR COMMIT.")
    work = Path(opts.work) if opts.work else Path(tempfile.mkdtemp(prefix="examples_swap_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        import transformers

        origin = (source / "SOURCE.txt").read_text().split("\n")[1] if (source / "SOURCE.txt").exists() else source
        print(f"transformers {transformers.__version__} installed; scripts from {origin}")
        results = run_scripts(source, names, work, opts.steps, opts.timeout, opts.jobs)
        print(table(results))
        failed = [(n, run) for n, runs in results.items() for run, c in check(runs).items() if not c["ok"]]
        for name, run in failed:
            print(f"{name}, {run}: FAIL; see {results[name][run]['log']}")
    finally:
        if not opts.work and not opts.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
