"""Run TRL's installed example scripts (`trl/scripts/sft.py`, `dpo.py`, `reward.py`) plain and with hf_accum's
classes swapped in, offline, with a target, and compare their first logged losses.

    python scripts/swap/trl_scripts_swap.py [--cases sft,sft-packed,dpo,reward] [--steps 3] [--jobs 2] [--work DIR]

"Swapped" is what a user does to an existing script: a text substitution of the trainer and its config in a copy of
the installed file (`SFTTrainer(` -> `AccumSFTTrainer(`, `SFTConfig` in the parser's dataclasses -> `AccumSFTConfig`,
one import line), run with the same TrlParser flags plus `--target_batch_size`. Both runs are offline on a tiny Llama
(hf_accum.tiny; its sequence-classification twin for reward.py) and its tokenizer saved to a temp folder, and local
JSONL data. Same effective batch: plain `--per_device_train_batch_size 4 --gradient_accumulation_steps 2`, swapped
the same flags and `--target_batch_size 8` (the tuner probes and plans it). Each run must exit 0 and save its model,
and its logged losses (read from the final checkpoint's trainer_state.json) must agree with the plain script's to
float32 noise (relative 1e-4). Prints a table; exits 1 when a case fails. tests/test_trl_scripts_swap.py runs the
SFT cases (packed and not) in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4  # relative: float32 sums in another order (the plan's micro-batch may differ from 4)

# script -> (trainer, config): the substitution
SCRIPTS = {"sft": ("SFTTrainer", "SFTConfig"), "dpo": ("DPOTrainer", "DPOConfig"),
           "reward": ("RewardTrainer", "RewardConfig")}
CASES = {  # case -> (script, extra flags)
    "sft": ("sft", []),
    "sft-packed": ("sft", ["--packing"]),
    "dpo": ("dpo", []),
    "reward": ("reward", []),
}


def swapped_source(text: str, trainer: str, config: str) -> str:
    """The script with hf_accum's classes in place of TRL's: each substitution must apply exactly once, so a changed
    upstream script fails here, not silently."""
    subs = [(f"trainer = {trainer}(", f"trainer = Accum{trainer}("),
            (f"dataclass_types = (ScriptArguments, {config},", f"dataclass_types = (ScriptArguments, Accum{config},"),
            ("\nimport argparse\n", f"\nimport argparse\n\nfrom hf_accum.trl import Accum{config}, Accum{trainer}\n")]
    for old, new in subs:
        if text.count(old) != 1:
            raise SystemExit(f"trl_scripts_swap: {old.strip()!r} occurs {text.count(old)} times in TRL's script "
                             "(expected once): the installed TRL's script changed; update the substitution")
        text = text.replace(old, new)
    return text


def prepare(work: Path) -> dict[str, Path]:
    """The tiny models (causal LM; sequence classification with one label for reward.py), their tokenizer and the
    JSONL data, saved under ``work``."""
    sys.path.insert(0, str(REPO))
    import torch

    from hf_accum import tiny

    tok = tiny.build_tokenizer()
    paths = {"causal": work / "tiny-llama", "cls": work / "tiny-llama-reward", "sft": work / "data-sft",
             "pref": work / "data-pref"}
    for kind, path, labels in (("causal_lm", paths["causal"], 2), ("seq_cls", paths["cls"], 1)):
        model = tiny.build_model(kind, tokenizer=tok, hidden_size=32, num_labels=labels, dtype=torch.float32)
        model.save_pretrained(path)
        tok.save_pretrained(path)
    rows = tiny.generate_instruction_data(64, seed=3)
    paths["sft"].mkdir()
    with open(paths["sft"] / "train.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"prompt": r["prompt"], "completion": r["response"]}) + "\n")
    paths["pref"].mkdir()
    with open(paths["pref"] / "train.jsonl", "w") as f:  # rejected: the response reversed, another length
        for r in rows:
            f.write(json.dumps({"prompt": r["prompt"], "chosen": r["response"],
                                "rejected": r["response"][::-1] + " no"}) + "\n")
    return paths


def script_copies(work: Path) -> dict[tuple[str, str], Path]:
    """(script, "plain" | "swapped") -> a copy of TRL's installed script (swapped: substituted)."""
    import trl

    folder = Path(trl.__file__).parent / "scripts"
    out = {}
    for name, (trainer, config) in SCRIPTS.items():
        text = (folder / f"{name}.py").read_text()
        for mode, source in (("plain", text), ("swapped", swapped_source(text, trainer, config))):
            path = work / f"{mode}_{name}.py"
            path.write_text(source)
            out[name, mode] = path
    return out


def fresh_interpreter(argv: list[str], env: dict[str, str], cwd: Path, log: Path, timeout: int) -> int:
    """``python ARGV...`` in a fresh interpreter, as a user runs TRL's script: its exit code, its output in ``log``."""
    with open(log, "w") as f:
        return subprocess.run([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                              timeout=timeout).returncode


def run_one(script: Path, flags: list[str], out: Path, log: Path, timeout: int, runner=fresh_interpreter) -> dict:
    """``runner(argv, env, cwd, log, timeout)`` runs ``python ARGV...`` and returns its exit code (the tests fork
    it from a preloaded server instead: tests/test_trl_scripts_swap.py)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               WANDB_DISABLED="true", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    start = time.time()
    rc = runner([str(script), *flags, "--output_dir", str(out)], env, out.parent, log, timeout)
    states = sorted(out.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    history = json.loads(states[-1].read_text())["log_history"] if states else []
    return {"rc": rc, "seconds": time.time() - start, "saved": any(out.glob("*.safetensors")),
            "losses": [h["loss"] for h in history if "loss" in h and "step" in h], "log": str(log)}


def flags_for(case: str, paths: dict[str, Path], steps: int) -> list[str]:
    script, extra = CASES[case]
    model = paths["cls"] if script == "reward" else paths["causal"]
    data = paths["sft"] if script == "sft" else paths["pref"]
    return ["--model_name_or_path", str(model), "--dataset_name", str(data), "--max_steps", str(steps),
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3",
            "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", str(steps), "--report_to", "none",
            "--use_cpu", "--bf16", "False", "--seed", "0", "--disable_tqdm", "True", "--max_length", "64",
            "--gradient_checkpointing", "False", "--dataloader_num_workers", "0", *extra]


def compare(plain: dict, swapped: dict) -> tuple[float | None, bool]:
    a, b = plain["losses"], swapped["losses"]
    if not a or len(a) != len(b):
        return None, False
    worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
    ok = plain["rc"] == swapped["rc"] == 0 and plain["saved"] and swapped["saved"] and worst <= TOLERANCE
    return worst, ok


def run_cases(cases: list[str], work: Path, steps: int = 3, timeout: int = 600, jobs: int = 2,
              runner=fresh_interpreter) -> list[dict]:
    """Every case plain and swapped, ``jobs`` script runs at a time (each is mostly imports), each by ``runner``
    (`run_one`)."""
    from concurrent.futures import ThreadPoolExecutor

    paths = prepare(work)
    scripts = script_copies(work)
    runs = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for case in cases:
            flags = flags_for(case, paths, steps)
            for mode, extra in (("plain", []), ("swapped", ["--target_batch_size", "8"])):
                runs[case, mode] = pool.submit(run_one, scripts[CASES[case][0], mode], [*flags, *extra],
                                               work / f"out-{case}-{mode}", work / f"{case}-{mode}.log", timeout,
                                               runner)
    results = []
    for case in cases:
        plain, swapped = runs[case, "plain"].result(), runs[case, "swapped"].result()
        worst, ok = compare(plain, swapped)
        results.append({"case": case, "plain": plain, "swapped": swapped, "max_rel_diff": worst, "ok": ok})
    return results


def table(results: list[dict]) -> str:
    def losses(r):
        return ", ".join(f"{x:.4f}" for x in r["losses"]) or "-"

    head = ("| case | plain: exit, saved, losses | swapped (target 8): exit, saved, losses | max rel diff | "
            "seconds plain / swapped | verdict |\n|---|---|---|---|---|---|")
    rows = [f"| {r['case']} | {r['plain']['rc']}, {'yes' if r['plain']['saved'] else 'no'}, {losses(r['plain'])} | "
            f"{r['swapped']['rc']}, {'yes' if r['swapped']['saved'] else 'no'}, {losses(r['swapped'])} | "
            f"{'-' if r['max_rel_diff'] is None else format(r['max_rel_diff'], '.1e')} | "
            f"{r['plain']['seconds']:.0f} / {r['swapped']['seconds']:.0f} | {'ok' if r['ok'] else 'FAIL'} |"
            for r in results]
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (default 3)")
    parser.add_argument("--work", help="folder for models, data, runs and logs (default: a temp folder, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per script run")
    parser.add_argument("--jobs", type=int, default=2, help="script runs at a time (default 2)")
    opts = parser.parse_args(argv)
    cases = [c for c in opts.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {', '.join(CASES)}")
    work = Path(opts.work) if opts.work else Path(tempfile.mkdtemp(prefix="trl_scripts_swap_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        results = run_cases(cases, work, opts.steps, opts.timeout, opts.jobs)
        print(table(results))
        for r in results:
            if not r["ok"]:
                print(f"{r['case']}: see {r['plain']['log']} and {r['swapped']['log']}")
    finally:
        if not opts.work and not opts.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
