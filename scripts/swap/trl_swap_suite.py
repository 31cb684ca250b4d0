"""Run TRL's own SFT / DPO / Reward / GRPO trainer tests plain and with hf_accum's classes swapped in, offline, side by side.

    python scripts/swap/trl_swap_suite.py TESTS_DIR [FILES...] [--modes plain,swapped,swapped-ga2,swapped-ga3,swapped-target]
                                     [-k EXPR] [--ga-k EXPR] [--timeout 300]
    python scripts/swap/trl_swap_suite.py TESTS_DIR --extract GIT_DIR COMMIT   # TRL's tests/ of COMMIT into TESTS_DIR

TESTS_DIR holds `tests/` of TRL at (or as near as can be had to) the installed version; never inside this repository.
FILES default to tests/test_sft_trainer.py tests/test_dpo_trainer.py tests/test_reward_trainer.py.

Modes (each a pytest subprocess with `trl_swap_conftest.py` as a plugin and a junit report):
- plain: TRL as installed;
- swapped: trl.SFTTrainer/SFTConfig, DPOTrainer/DPOConfig, RewardTrainer/RewardConfig are hf_accum.trl's
  AccumSFTTrainer/AccumSFTConfig, ... with gradient_accumulation_steps as the tests set it;
- swapped-gaN: swapped, every config forced to gradient_accumulation_steps=N (no upstream test sets it).
  Its baseline is plain-gaN (TRL forced to N), run only on the tests that fail swapped-gaN and pass plain (a test
  that also fails with TRL at GA N is not ours).
- swapped-target (and swapped-target-gaN): swapped, every one of our configs given the `target_batch_size` its batch
  settings already imply (per_device_train_batch_size x gradient_accumulation_steps x world), as a new user would set
  it: the probe and the planner run in every test, and the effective batch must come out the same. Its baseline is
  plain (plain-gaN): TRL has no target.
`-k` selects the tests of every mode, `--ga-k` further narrows the GA modes (defaults: K and GA_K below).

Offline: the hub models and datasets the tests load are replaced by local stand-ins (`trl_standins.py`, a hub cache
under --out); a test that needs one with no stand-in is skipped, in every mode alike. The table gives per file and
mode passed / failed / error / skipped, then every test that passes with TRL and fails with ours, marked "allowed"
when it is one of the batch-dependent DPO loss types hf_accum refuses (aot, aot_unpaired, bco_pair, and a loss
combination containing one). Not part of CI.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from trainer_swap_suite import outcomes  # noqa: E402  (junit -> {test id: (result, message)})

FILES = ["tests/test_sft_trainer.py", "tests/test_dpo_trainer.py", "tests/test_reward_trainer.py",
         "tests/test_grpo_trainer.py"]
MODES = ["plain", "swapped", "swapped-ga2", "swapped-ga3"]
# What fits an afternoon on 2 shared CPU cores (~5 s a test): the trainer tests of the three files (the collator,
# chunked-loss, VLM and GPU-only classes build none of our trainers), SFT's narrowed to a representative set, and
# for the GA modes the training runs whose loss accumulation GA changes. `-k ""` / `--ga-k ""` run everything.
_SFT = ("test_train_dataset_format or test_train_model or test_train_gpt_oss or test_train_moe or "
        "test_train_padding_free or test_train_packing or test_train_completion_only or test_train_assistant_only")
# GRPO's training runs on the transformers generation path (no vLLM, environments, VLMs or liger kernels)
_GRPO = ("(test_train and not test_train_) or test_train_loss_types or test_train_peft_model or test_train_beta_non_zero "
         "or test_train_multiple_reward_funcs or test_train_with_pad_to_multiple_of or test_train_scale_rewards or "
         "test_train_with_mask_truncated_completions or test_train_num_generations_larger_than_batch_size or "
         "test_train_delta_clipping or test_train_sequence_importance_sampling or test_train_with_bias_correction_kl "
         "or test_train_peft_config or test_train_dataset_format or test_train_multiple_iterations or "
         "test_train_with_entropy_filter or test_train_with_static_entropy")
K = (f"(TestSFTTrainer and ((test_train and not test_train_) or {_SFT} or test_train_with_eval or "
     "test_train_nll_loss or test_train_dft_loss or test_train_with_iterable_dataset or "
     "test_train_with_gradient_checkpointing)) or ((TestDPOTrainer or TestRewardTrainer) and not VLM and not Slow) or "
     f"(TestGRPOTrainer and ({_GRPO}))")
GA_K = (f"(TestSFTTrainer and ({_SFT} or (test_train and not test_train_))) or (TestDPOTrainer and "
        "(test_train_loss_types or test_train_multi_loss_types or test_train_model or test_train_moe or "
        "test_train_gpt_oss or test_train_with_iterable_dataset or test_train_padding_free or "
        "(test_train and not test_train_))) or (TestRewardTrainer and (test_train_dataset_types or test_train_model "
        "or test_train_moe or test_train_with_margin or test_train_with_center or test_train_with_iterable or "
        "(test_train and not test_train_)))")
BAD = ("failed", "error")
# DPO loss types whose loss depends on the whole batch, refused by hf_accum (trl_support.PER_PAIR_DPO_LOSSES):
# a test parametrized with one of them by name, or TRL's MPO combination (sigmoid + bco_pair + sft), may fail.
# bnpo: GRPO's per-forward token mean (its test id carries a second parameter: [bnpo-False])
BATCH_DEPENDENT = re.compile(r"\[(aot|aot_unpaired|bco_pair|bnpo)(-[^\]]*)?\]$")
MPO_TESTS = {"test_train_multi_loss_types"}


def allowed(test_id: str) -> bool:
    """Whether a test failing only with hf_accum's classes is an allowed (refused, batch-dependent) loss type."""
    name = test_id.rpartition("::")[2]
    return bool(BATCH_DEPENDENT.search(name)) or name in MPO_TESTS


def mode_env(mode: str) -> dict[str, str]:
    """The plugin's environment for a mode: "plain", "swapped", "swapped-target", "plain-ga2", "swapped-ga3",
    "swapped-target-ga2", ..."""
    kind, _, ga = mode.partition("-ga")
    if kind not in ("plain", "swapped", "swapped-target") or (ga and not ga.isdigit()):
        raise ValueError(f"mode {mode!r}: expected plain, swapped or swapped-target, optionally with -gaN (e.g. "
                         "swapped-ga2)")
    return {"HF_ACCUM_TRL_SWAP": "0" if kind == "plain" else "1", "HF_ACCUM_TRL_GA": ga,
            "HF_ACCUM_TRL_TARGET": "1" if kind == "swapped-target" else ""}


def baseline_of(mode: str) -> str:
    """The TRL run a swapped mode is compared with: plain at the same forced GA (TRL has no target)."""
    return mode.replace("swapped-target", "plain").replace("swapped", "plain")


def extract(git_dir: str, commit: str, dest: Path) -> None:
    """`tests/` of COMMIT, via `git archive` (no work tree needed), and where it came from in SOURCE.txt."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as tar:
        subprocess.run(["git", f"--git-dir={git_dir}", "archive", commit, "tests"], stdout=tar, check=True)
        tar.seek(0)
        with tarfile.open(fileobj=tar) as archive:
            archive.extractall(dest, filter="data")
    info = subprocess.run(["git", f"--git-dir={git_dir}", "log", "-1", "--format=%H %cI", commit],
                          capture_output=True, text=True, check=True).stdout.strip()
    (dest / "SOURCE.txt").write_text(f"git dir {git_dir}\ncommit {info}\n")
    print(f"extracted tests/ of {info} into {dest}")


def run_pytest(mode, tests_dir: Path, targets: list[str], out: Path, opts, k: str | None):
    junit, record = out / f"{mode}.xml", out / f"{mode}.trainers.jsonl"
    record.unlink(missing_ok=True)
    ini = out / "pytest.ini"  # ours, so no pytest configuration above TESTS_DIR is picked up
    ini.write_text("[pytest]\nfilterwarnings =\n    ignore::DeprecationWarning\n")
    env = dict(os.environ, **mode_env(mode), HF_ACCUM_TRL_RECORD=str(record), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", HF_HUB_CACHE=str(out / "hub"), TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    cmd = [sys.executable, "-m", "pytest", *targets, "-p", "trl_swap_conftest", "-p", "no:cacheprovider",
           "-c", str(ini), "--rootdir", str(tests_dir), f"--junitxml={junit}", f"--timeout={opts.timeout}",
           "-q", "-rN", "--no-header", "--continue-on-collection-errors"] + (["-k", k] if k else [])
    shown = cmd if len(targets) < 8 else cmd[:3] + [f"<{len(targets)} test ids>"] + cmd[3 + len(targets):]
    print(f"\n[{mode}] {' '.join(shown)}", flush=True)
    start = time.monotonic()
    with open(out / f"{mode}.log", "w") as log:
        subprocess.run(cmd, cwd=tests_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
    (out / f"{mode}.seconds").write_text(f"{time.monotonic() - start:.0f}")


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def regressions(ours: dict, theirs: dict) -> list[str]:
    """Tests that fail with ours and do not fail with TRL (passed, or skipped there)."""
    return sorted(t for t, (r, _) in ours.items() if r in BAD and theirs.get(t, ("-",))[0] not in BAD)


def file_of(test_id: str) -> str:
    return test_id.split("::")[0]


def summary(results: dict[str, dict]) -> None:
    print(f"\n{'file':<30} {'mode':<13}" + "".join(f"{k:>9}" for k in ("passed", "failed", "error", "skipped",
                                                                          "total")))
    files = sorted({file_of(t) for r in results.values() for t in r})
    for name in files:
        for mode, result in results.items():
            counts = collections.Counter(r for t, (r, _) in result.items() if file_of(t) == name)
            if counts:
                print(f"{name:<30} {mode:<13}" + "".join(f"{counts[k]:>9}" for k in ("passed", "failed", "error",
                                                                                       "skipped"))
                      + f"{sum(counts.values()):>9}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests_dir", type=Path)
    parser.add_argument("files", nargs="*", default=FILES)
    parser.add_argument("--extract", nargs=2, metavar=("GIT_DIR", "COMMIT"))
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated (default {','.join(MODES)})")
    parser.add_argument("--timeout", type=int, default=300, help="per-test timeout in seconds (pytest-timeout)")
    parser.add_argument("-k", default=K, help="pytest -k expression for every mode (default: %(default)s)")
    parser.add_argument("--ga-k", default=GA_K, help="pytest -k expression for the -gaN modes (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "trl_swap",
                        help="junit reports, logs, trainer records, stand-in hub cache (default runs/trl_swap)")
    parser.add_argument("--report-only", action="store_true", help="re-print the tables from the last run")
    opts = parser.parse_args(argv)

    tests_dir = opts.tests_dir.resolve()
    if tests_dir == REPO or REPO in tests_dir.parents:
        parser.error(f"{tests_dir} is inside this repository; TRL's tests must stay outside it.")
    if opts.extract:
        extract(*opts.extract, tests_dir)
        return 0
    missing = [f for f in opts.files if not (tests_dir / f).exists()]
    if missing:
        parser.error(f"{', '.join(missing)} not found in {tests_dir}; fill it with --extract GIT_DIR COMMIT.")
    modes = opts.modes.split(",")
    for mode in modes:
        mode_env(mode)
    opts.out.mkdir(parents=True, exist_ok=True)

    import transformers
    import trl
    import trl_standins

    print(f"trl {trl.__version__}, transformers {transformers.__version__} (installed); tests from {tests_dir}")
    if (tests_dir / "SOURCE.txt").exists():
        print("  " + (tests_dir / "SOURCE.txt").read_text().strip().replace("\n", "\n  "))
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print(f"hf_accum at {head.stdout.strip() or '?'}; files: {' '.join(opts.files)}")
    if not opts.report_only:
        print("stand-ins: " + ", ".join(trl_standins.populate_cache(opts.out / "hub")), flush=True)

    results = {}
    for mode in modes:
        ga = "-ga" in mode
        if not opts.report_only:
            k = " and ".join(f"({e})" for e in (opts.k, opts.ga_k if ga else None) if e) or None
            run_pytest(mode, tests_dir, opts.files, opts.out, opts, k)
        results[mode] = outcomes(opts.out / f"{mode}.xml")
        baseline = baseline_of(mode)
        if ga and mode.startswith("swapped"):
            suspects = regressions(results[mode], results.get("plain", {}))
            if suspects and not opts.report_only:
                run_pytest(baseline, tests_dir, suspects, opts.out, opts, None)
            results[baseline] = outcomes(opts.out / f"{baseline}.xml") if suspects else {}

    summary({m: r for m, r in results.items() if r})
    for mode in modes:
        if not mode.startswith("swapped"):
            continue
        baseline = baseline_of(mode)
        theirs = {**results.get("plain", {}), **results.get(baseline, {})}
        only = regressions(results[mode], theirs)
        print(f"\n{mode}: pass with TRL ({baseline}), fail with ours: {len(only)} "
              f"({sum(allowed(t) for t in only)} allowed batch-dependent loss types)")
        for test in only:
            print(f"  {'allowed ' if allowed(test) else 'FAILING '}{test}\n      {results[mode][test][1]}")

    for mode in modes:
        built = [r for r in records(opts.out / f"{mode}.trainers.jsonl") if r["kind"] == "trainer"]
        classes = collections.Counter(r["cls"].rpartition(".")[2] for r in built)
        gas = collections.Counter(r["ga"] for r in built)
        targets = collections.Counter(r.get("target") for r in built)
        print(f"\n{mode}: {len(built)} trainers built, {sum(r['accum'] for r in built)} of them hf_accum's; "
              f"classes {dict(classes)}; gradient_accumulation_steps {dict(gas)}; target_batch_size {dict(targets)}")
        seconds = opts.out / f"{mode}.seconds"
        if seconds.exists():
            print(f"  ran {seconds.read_text()} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
