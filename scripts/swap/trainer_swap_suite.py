"""Run transformers' own Trainer tests plain and with `Trainer` swapped for `AccumTrainer` (optionally with a target
set), side by side.

    python scripts/swap/trainer_swap_suite.py TESTS_DIR [FILES...] [--modes plain,swapped,swapped-target] [--timeout 120]
                                         [-k EXPR] [--site DIR] [--standins]

TESTS_DIR holds `tests/__init__.py` and `tests/trainer/` of transformers at (or as near as can be had to) the
installed version. The files are not ours: they are never copied into this repository, and the script refuses a
TESTS_DIR inside it. To fill TESTS_DIR from a git directory of transformers (or a fork of it):

    python scripts/swap/trainer_swap_suite.py TESTS_DIR --extract GIT_DIR COMMIT

FILES are paths relative to TESTS_DIR (default: tests/trainer). `--site` adds a folder of extra test
dependencies (e.g. `pip install --target DIR parameterized timeout-decorator`) to the runs' PYTHONPATH.
`--standins` runs offline what test_trainer_seq2seq.py's `TestTranslationExample` loads from the hub: a tiny MBart
built from config with hf_accum.tiny's tokenizer as "sshleifer/tiny-mbart" (in a hub cache under --out, the runs'
HF_HUB_CACHE), and `evaluate` / `nltk` replaced by examples_swap.py's offline stand-ins (BLEU computed locally).

Modes (default plain,swapped), run one after the other, each a pytest subprocess with `swap_conftest.py` loaded as a
plugin and a junit report:
- plain: transformers as installed (HF_ACCUM_SWAP=0);
- swapped: `Trainer` is `AccumTrainer` and `Seq2SeqTrainer` is `AccumSeq2SeqTrainer`, with the arguments as the tests
  give them (HF_ACCUM_SWAP=1);
- swapped-target: swapped, and `TrainingArguments` is `AccumTrainingArguments` (`Seq2SeqTrainingArguments`:
  `AccumSeq2SeqTrainingArguments`) with every object given the
  `target_batch_size` its batch settings already imply (per_device_train_batch_size x gradient_accumulation_steps x
  world), as a new user would set it (HF_ACCUM_SWAP_TARGET=1): the probe and the planner run in every test, and the
  effective batch must come out the same.
The table lists every test with its result per mode, then per swapped mode every test that fails there and not
plain, and how many of the trainers each run built were really `AccumTrainer`. Not part of CI.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BAD = ("failed", "error")
MODES = ("plain", "swapped", "swapped-target")
# what test_trainer_seq2seq.py's TestTranslationExample reads beside tests/trainer
EXAMPLE_PATHS = ("examples/pytorch/translation", "tests/fixtures/tests_samples/wmt_en_ro")
MBART_TINY = "sshleifer/tiny-mbart"


def mode_env(mode: str) -> dict[str, str]:
    """The plugin's environment for a mode (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    return {"HF_ACCUM_SWAP": "0" if mode == "plain" else "1",
            "HF_ACCUM_SWAP_TARGET": "1" if mode == "swapped-target" else "0"}


def extract(git_dir: str, commit: str, dest: Path) -> None:
    """`tests/__init__.py` and `tests/trainer/` of COMMIT, via `git archive` (no work tree needed)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as tar:
        subprocess.run(["git", f"--git-dir={git_dir}", "archive", commit, "tests/__init__.py", "tests/trainer",
                        *EXAMPLE_PATHS], stdout=tar, check=True)
        tar.seek(0)
        with tarfile.open(fileobj=tar) as archive:
            archive.extractall(dest, filter="data")
    sha = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", commit], capture_output=True, text=True,
                         check=True).stdout.strip()
    date = subprocess.run(["git", f"--git-dir={git_dir}", "log", "-1", "--format=%cI", commit],
                          capture_output=True, text=True, check=True).stdout.strip()
    (dest / "SOURCE.txt").write_text(f"git dir {git_dir}\ncommit {sha} ({date})\n")
    print(f"extracted tests/trainer of {sha} ({date}) into {dest}")


def write_standins(out: Path) -> tuple[Path, Path]:
    """The hub cache holding the tiny MBart stand-in for MBART_TINY, and the folder of the `evaluate` / `nltk`
    stand-ins; kept when already written (same code, same seed: same weights)."""
    sys.path.insert(0, str(REPO))
    import examples_swap

    hub, shims = out / "hub", out / "shims"
    repo = hub / ("models--" + MBART_TINY.replace("/", "--"))
    snapshot = repo / "snapshots" / ("0" * 40)
    if not (snapshot / "config.json").exists():
        import torch
        from transformers import MBartConfig, MBartForConditionalGeneration

        from hf_accum import tiny

        tok = tiny.build_tokenizer()
        torch.manual_seed(0)
        MBartForConditionalGeneration(MBartConfig(
            vocab_size=len(tok), d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=128,
            pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            decoder_start_token_id=tok.eos_token_id)).save_pretrained(snapshot)
        tok.save_pretrained(snapshot)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text("0" * 40)
    for module, text in (("evaluate", examples_swap.EVALUATE_SHIM), ("nltk", examples_swap.NLTK_SHIM)):
        (shims / module).mkdir(parents=True, exist_ok=True)
        (shims / module / "__init__.py").write_text(text)
    return hub, shims


def run_pytest(mode: str, tests_dir: Path, files: list[str], out: Path, opts) -> tuple[Path, Path, float]:
    junit, record = out / f"{mode}.xml", out / f"{mode}.trainers.jsonl"
    record.unlink(missing_ok=True)
    ini = out / "pytest.ini"  # ours, so no pytest configuration above TESTS_DIR is picked up
    ini.write_text("[pytest]\nfilterwarnings =\n    ignore::DeprecationWarning\n")
    env = dict(os.environ, **mode_env(mode), HF_ACCUM_SWAP_RECORD=str(record),
               HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"), TOKENIZERS_PARALLELISM="false")
    paths = [str(HERE)] + ([opts.site] if opts.site else []) + [p for p in [env.get("PYTHONPATH")] if p]
    if opts.standins:
        hub, shims = write_standins(out)
        env["HF_HUB_CACHE"] = str(hub)
        paths.insert(1, str(shims))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    cmd = [sys.executable, "-m", "pytest", *files, "-p", "swap_conftest", "-p", "no:cacheprovider",
           "-c", str(ini), "--rootdir", str(tests_dir), f"--junitxml={junit}", f"--timeout={opts.timeout}",
           "-q", "-rN", "--no-header", "--continue-on-collection-errors"]
    if opts.k:
        cmd += ["-k", opts.k]
    print(f"\n[{mode}] {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    with open(out / f"{mode}.log", "w") as log:
        subprocess.run(cmd, cwd=tests_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
    return junit, record, time.monotonic() - start


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """test id -> (passed|failed|error|skipped, first line of the message)."""
    results = {}
    if not junit.exists():
        return results
    for case in ET.parse(junit).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        parts = cls.split(".")
        # classname is "tests.trainer.test_x.Class" (or "tests.trainer.test_x" for functions / module errors)
        idx = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        if not cls:  # a module that could not be collected
            test_id = name.replace(".", "/") + ".py::<collection>"
        else:
            test_id = "/".join(parts[: idx + 1]) + ".py" + "".join("::" + p for p in parts[idx + 1:]) + "::" + name
        result, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                result = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or (child.text or "")).strip().splitlines()[0:1]
                message = message[0][:160] if message else ""
                if result != "skipped":
                    break
        results[test_id] = (result, message)
    return results


def trainer_counts(record: Path):
    trainers, modules, swaps = [], {}, []
    if record.exists():
        for line in record.read_text().splitlines():
            entry = json.loads(line)
            if entry["kind"] == "trainer":
                trainers.append(entry)
            elif entry["kind"] == "module":
                modules[entry["module"]] = entry
            else:
                swaps.append(entry)
    return trainers, modules, swaps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests_dir", type=Path)
    parser.add_argument("files", nargs="*", default=["tests/trainer"])
    parser.add_argument("--extract", nargs=2, metavar=("GIT_DIR", "COMMIT"))
    parser.add_argument("--modes", default="plain,swapped", help=f"comma-separated, of {', '.join(MODES)} "
                        "(default %(default)s); plain is always run first, as the baseline")
    parser.add_argument("--timeout", type=int, default=120, help="per-test timeout in seconds (pytest-timeout)")
    parser.add_argument("-k", help="pytest -k expression, e.g. to deselect tests that hang")
    parser.add_argument("--site", help="folder with extra test dependencies, added to PYTHONPATH")
    parser.add_argument("--standins", action="store_true", help=f"offline stand-ins for {MBART_TINY} and the "
                        "evaluate / nltk modules run_translation.py loads (see above)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "trainer_swap",
                        help="junit reports, logs and trainer records (default runs/trainer_swap, git-ignored)")
    parser.add_argument("--report-only", action="store_true", help="re-print the table from the last run")
    opts = parser.parse_args(argv)

    tests_dir = opts.tests_dir.resolve()
    if tests_dir == REPO or REPO in tests_dir.parents:
        parser.error(f"{tests_dir} is inside this repository; transformers' tests must stay outside it.")
    if opts.extract:
        extract(*opts.extract, tests_dir)
        return 0
    if not (tests_dir / "tests" / "trainer").is_dir():
        parser.error(f"{tests_dir}/tests/trainer not found; fill it with --extract GIT_DIR COMMIT.")
    opts.out.mkdir(parents=True, exist_ok=True)

    import transformers

    print(f"transformers {transformers.__version__} (installed); tests from {tests_dir}")
    if (tests_dir / "SOURCE.txt").exists():
        print("  " + (tests_dir / "SOURCE.txt").read_text().strip().replace("\n", "\n  "))
    print(f"files: {' '.join(opts.files)}")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "hf_accum"], capture_output=True,
                           text=True)
    print(f"hf_accum at {head.stdout.strip() or '?'}" + (" with uncommitted changes in hf_accum/" if dirty.stdout.strip()
                                                        else ""))

    modes = ["plain"] + [m for m in opts.modes.split(",") if m != "plain"]
    for mode in modes:
        mode_env(mode)
    runs = {}
    for mode in modes:
        junit, record = opts.out / f"{mode}.xml", opts.out / f"{mode}.trainers.jsonl"
        seconds = None
        if not opts.report_only:
            junit, record, seconds = run_pytest(mode, tests_dir, opts.files, opts.out, opts)
        runs[mode] = (outcomes(junit), trainer_counts(record), seconds)

    plain = runs["plain"][0]
    ids = sorted(set().union(*(r[0] for r in runs.values())))
    width = max([len(t) for t in ids] + [10])
    print(f"\n{'test':<{width}}  " + "  ".join(f"{m:<14}" for m in modes))
    for test in ids:
        got = [runs[m][0].get(test, ("-", ""))[0] for m in modes]
        flag = "  <-- swapped only" if any(r in BAD for r in got[1:]) and got[0] not in BAD else ""
        print(f"{test:<{width}}  " + "  ".join(f"{r:<14}" for r in got) + flag)

    print(f"\n{'summary':<16}" + "  ".join(f"{k:>8}" for k in ("passed", "failed", "error", "skipped", "total")))
    for mode in modes:
        counts = collections.Counter(r for r, _ in runs[mode][0].values())
        seconds = runs[mode][2]
        print(f"{mode:<14}  " + "  ".join(f"{counts[k]:>8}" for k in ("passed", "failed", "error", "skipped"))
              + f"  {sum(counts.values()):>8}" + (f"   ({seconds:.0f} s)" if seconds else ""))

    for mode in modes[1:]:
        ours = runs[mode][0]
        only = [t for t in ids if ours.get(t, ("-",))[0] in BAD and plain.get(t, ("-",))[0] not in BAD]
        fixed = [t for t in ids if plain.get(t, ("-",))[0] in BAD and ours.get(t, ("-",))[0] not in BAD]
        print(f"\nfailing only {mode}: {len(only)}")
        for test in only:
            print(f"  {test}\n      {ours[test][0]}: {ours[test][1]}")
        if fixed:
            print(f"failing only plain (not {mode}): {len(fixed)}")
            for test in fixed:
                print(f"  {test}\n      {plain[test][0]}: {plain[test][1]}")

    for mode in modes:
        trainers, modules, swaps = runs[mode][1]
        accum = sum(t["accum"] for t in trainers)
        tests = {t["test"] for t in trainers}
        targeted = sum(t.get("target") is not None for t in trainers)
        print(f"\n{mode}: {len(trainers)} trainers built in {len(tests)} tests; AccumTrainer: {accum}; "
              f"with a target_batch_size: {targeted}")
        if mode != "plain":
            for swap in swaps:
                print(f"  replaced {', '.join(swap['replaced'])} by {swap['by']}")
            other = collections.Counter(t["cls"] for t in trainers if not t["accum"])
            for cls, n in other.most_common():
                print(f"  not AccumTrainer: {n} x {cls}")
            for name, entry in sorted(modules.items()):
                if entry["trainer"] is None:
                    continue
                print(f"  {name}.Trainer -> {entry['trainer']}{'' if entry['accum'] else '  (NOT swapped)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
