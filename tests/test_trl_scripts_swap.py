"""scripts/swap/trl_scripts_swap.py on TRL's installed `trl/scripts/sft.py`, unpacked and packed: the script with
AccumSFTTrainer / AccumSFTConfig substituted (as a user would) runs with `--target_batch_size 8`, exits 0, saves,
and logs the losses of the plain script at the same effective batch (4 x 2), to float32 noise."""

from pathlib import Path

import pytest

from tests.swap_scripts import load

pytest.importorskip("trl")



swap = load("trl_scripts_swap")


def test_the_substitution_applies_once_or_names_what_changed():
    text = "\nimport argparse\n\ndef main():\n    trainer = SFTTrainer(\n\ndataclass_types = (ScriptArguments, SFTConfig, X)"
    out = swap.swapped_source(text, "SFTTrainer", "SFTConfig")
    assert "trainer = AccumSFTTrainer(" in out and "(ScriptArguments, AccumSFTConfig, X)" in out
    assert "from hf_accum.trl import AccumSFTConfig, AccumSFTTrainer\n" in out
    with pytest.raises(SystemExit, match=r"'trainer = SFTTrainer\(' occurs 0 times in TRL's script"):
        swap.swapped_source(text.replace("SFTTrainer(", "Other("), "SFTTrainer", "SFTConfig")


def forked(argv, env, cwd, log, timeout):
    """``python ARGV...`` as `tests.launch` runs a one-process launch: forked from the server that imported torch,
    transformers, DeepSpeed and hf_accum once, the script run as ``python`` runs it (`runpy`, as ``__main__``). Four
    fresh interpreters cost this test ~140 CPU-s, mostly imports (py-spy over a README run, 2026-11-29);
    `scripts/swap/trl_scripts_swap.py` run by hand still starts a fresh one per script."""
    from tests.launch import launch

    done = launch(argv[0], *argv[1:], nproc=None, timeout=timeout, env=env, cwd=cwd)
    Path(log).write_text(done.stdout + done.stderr)
    return done.returncode


@pytest.mark.slow  # four script runs
def test_trl_sft_script_swapped_trains_as_the_plain_one_packed_and_not(tmp_path):
    from tests.launch import _forkserver

    _forkserver()  # started before the runs' threads ask for it
    results = swap.run_cases(["sft", "sft-packed"], tmp_path, steps=2, timeout=300, jobs=2, runner=forked)
    print(swap.table(results))
    for r in results:
        for mode in ("plain", "swapped"):
            assert r[mode]["rc"] == 0 and r[mode]["saved"], (r["case"], mode, r[mode]["log"])
        assert len(r["swapped"]["losses"]) == 2
        assert r["swapped"]["losses"] == pytest.approx(r["plain"]["losses"], rel=swap.TOLERANCE)
        assert "hf_accum plan: micro" in Path(r["swapped"]["log"]).read_text()  # the tuner planned the target
    # packing changes what a step trains on: the packed case really packed
    assert results[0]["plain"]["losses"][0] != pytest.approx(results[1]["plain"]["losses"][0], rel=1e-6)
