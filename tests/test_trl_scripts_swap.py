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


@pytest.mark.slow  # four script runs, each mostly imports: ~40 s on 2 idle cores
def test_trl_sft_script_swapped_trains_as_the_plain_one_packed_and_not(tmp_path):
    results = swap.run_cases(["sft", "sft-packed"], tmp_path, steps=2, timeout=300, jobs=4)
    print(swap.table(results))
    for r in results:
        for mode in ("plain", "swapped"):
            assert r[mode]["rc"] == 0 and r[mode]["saved"], (r["case"], mode, r[mode]["log"])
        assert len(r["swapped"]["losses"]) == 2
        assert r["swapped"]["losses"] == pytest.approx(r["plain"]["losses"], rel=swap.TOLERANCE)
        assert "hf_accum plan: micro" in Path(r["swapped"]["log"]).read_text()  # the tuner planned the target
    # packing changes what a step trains on: the packed case really packed
    assert results[0]["plain"]["losses"][0] != pytest.approx(results[1]["plain"]["losses"][0], rel=1e-6)
