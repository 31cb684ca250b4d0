"""What fits where (`hf-accum probe --estimate` with comma lists): the grid, the reading of peaks, the smallest card
that would, the table and the JSON, and the table against one estimate per card."""

import json

import pytest

from hf_accum.probing import fits
from hf_accum.probing.fits import Cell, largest_fit, parse_list, peak_at, plan_cells, smallest_card
from hf_accum.probing.paper import parse_size

GiB = 2**30
MiB = 2**20


# --- pure logic ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("512", [512]), ("512,2048,8192", [512, 2048, 8192]), (" 512 , 2048 ", [512, 2048]), ("512,512,64", [512, 64]),
])
def test_parse_list(text, expected):
    assert parse_list(text, int, "--seq-len") == expected


@pytest.mark.parametrize("text", ["512,,2048", "512,", ",512"])
def test_parse_list_refuses_an_empty_value_naming_the_flag(text):
    with pytest.raises(ValueError, match="--seq-len"):
        parse_list(text, int, "--seq-len")


LINEAR = {1: 95, 2: 200, 3: 300, 8: 800, 9: 900}  # 100 per row from 2 on; 1 below the line (no padding mask)


@pytest.mark.parametrize("peaks, budget, cap, expected", [
    (LINEAR, 90, 32, 0),        # not even 1
    (LINEAR, 95, 32, 1),
    (LINEAR, 199, 32, 1),
    (LINEAR, 200, 32, 2),
    (LINEAR, 550, 32, 5),       # between 3 and 8: on the line
    (LINEAR, 899, 32, 8),
    (LINEAR, 10_000, 32, 9),    # above the largest size measured nothing is claimed
    (LINEAR, 10_000, 9, 9),
    (LINEAR, 550, 4, 4),        # the cap
    ({1: 95, 8: 800, 9: 900}, 550, 32, 5),  # 1 and 8 around: the line through 8 and 9, not the chord from 1
    ({1: 95, 8: 800}, 500, 32, 5),          # no size above 8: the chord from 1 (95 + 705/7 per row)
    ({1: 700, 4: 700, 5: 750}, 720, 32, 4),  # flat where the optimizer step sets the peak: never below the peak at 1
    ({}, 100, 32, 0),
])
def test_largest_fit(peaks, budget, cap, expected):
    assert largest_fit(peaks, budget, cap) == expected


def test_peak_at_is_measured_where_measured_and_on_the_line_from_2_on():
    assert peak_at(LINEAR, 2) == 200
    assert peak_at(LINEAR, 5) == 500
    assert peak_at({1: 95, 8: 800, 9: 900}, 2) == 200


@pytest.mark.parametrize("peak_one, fraction, expected", [
    (5 * GiB, 0.9, 8), (int(0.9 * 8 * GiB), 0.9, 8), (int(0.9 * 8 * GiB) + 1, 0.9, 16), (30 * GiB, 0.9, 40),
    (75 * GiB, 0.9, 96), (100 * GiB, 0.9, 141), (127 * GiB, 0.9, None), (30 * GiB, 0.5, 80), (None, 0.9, None),
])
def test_smallest_card(peak_one, fraction, expected):
    assert smallest_card(peak_one, fraction) == expected


def _recording(tables):
    calls = []

    def measure(seq, lever, card):
        calls.append((seq, lever, card // GiB))
        return tables[seq, lever], None

    return measure, calls


def test_the_grid_checkpoints_only_where_micro_batch_1_does_not_fit_and_names_the_smallest_card():
    per_row = {512: 1 * GiB, 8192: 16 * GiB}
    base = 20 * GiB
    tables = {(s, None): {m: base + m * r for m in (1, 2, 3, 4)} for s, r in per_row.items()}
    tables[8192, "all"] = {m: base + m * 2 * GiB for m in (1, 2, 3, 4)}
    measure, calls = _recording(tables)
    cards = [24 * GiB, 48 * GiB]
    cells = plan_cells(cards, [512, 8192], measure, fraction=0.9, cap=4)
    by = {(c.seq_len, c.card_bytes // GiB): c for c in cells}
    # seq 512: budget 21.6 GiB on 24 GiB holds 1 row; 43.2 GiB on 48 GiB holds 4 (the cap): no lever tried
    assert (by[512, 24].micro_batch, by[512, 24].checkpointing) == (1, "none")
    assert (by[512, 48].micro_batch, by[512, 48].capped) == (4, True)
    # seq 8192: 36 GiB at 1 row without checkpointing; with every layer checkpointed 22 GiB (24 GiB: no) ...
    assert not by[8192, 24].fits and (by[8192, 24].smallest_card_gib, by[8192, 24].needs) == (40, "none")
    # ... 48 GiB: 1 row without checkpointing fits, so no lever is needed there; the lever, estimated for 24 GiB
    # anyway, fits 4 (the cap) and the cell says so
    assert (by[8192, 48].micro_batch, by[8192, 48].checkpointing, by[8192, 48].more) == (1, "none", (4, "all", True))
    assert fits.cell_text(by[8192, 48]) == "1 (4+ checkpointing all layers)"
    assert by[512, 24].more is None  # the lever was not estimated at 512: nothing is claimed for it
    # the largest card first; each (seq, lever) estimated once where its sizes decide every card; the lever only
    # for the card that needs it
    assert calls == [(512, None, 48), (8192, None, 48), (8192, "all", 24)]


def test_the_grid_uses_the_lever_where_it_is_what_fits():
    tables = {(512, None): {1: 30 * GiB, 2: 40 * GiB}, (512, "all"): {m: (8 + 2 * m) * GiB for m in range(1, 10)}}
    measure, calls = _recording(tables)
    cells = plan_cells([16 * GiB, 24 * GiB], [512], measure, fraction=0.9, cap=8)
    # budgets 14.4 and 21.6 GiB: 3 and 6 rows with every layer checkpointed, decided by the sizes measured
    assert [(c.micro_batch, c.checkpointing) for c in cells] == [(3, "all"), (6, "all")]
    assert calls == [(512, None, 24), (512, "all", 24)]
    assert "checkpointing all layers" in fits.cell_text(cells[0])


def test_a_lever_that_fit_nothing_is_not_estimated_again_at_a_longer_sequence():
    """Full fine-tuning of an 8B model: micro-batch 1 fits no card at 512 without checkpointing, so at 2048 only the
    lever is estimated; the lever fitting nothing either is still estimated, its peak naming the card that would."""
    tables = {(512, None): {1: 80 * GiB}, (512, "all"): {1: 76 * GiB},
              (2048, "all"): {1: 77 * GiB}, (8192, "all"): {1: 100 * GiB}}
    measure, calls = _recording(tables)
    cells = plan_cells([80 * GiB, 24 * GiB], [8192, 512, 2048], measure, fraction=0.9, cap=8)
    assert calls == [(512, None, 80), (512, "all", 80), (2048, "all", 80), (8192, "all", 80)]
    assert [(c.seq_len, c.card_bytes // GiB, fits.cell_text(c)) for c in cells] == [
        (512, 24, "does not fit (96 GiB would)"),  # 96 GiB holds micro-batch 1 without the lever: fewest levers
        (512, 80, "does not fit (96 GiB would)"),
        (2048, 24, "does not fit (96 GiB would, checkpointing all)"),
        (2048, 80, "does not fit (96 GiB would, checkpointing all)"),
        (8192, 24, "does not fit (141 GiB would, checkpointing all)"),
        (8192, 80, "does not fit (141 GiB would, checkpointing all)")]


def test_a_smaller_card_whose_edge_the_sizes_measured_do_not_decide_is_estimated_itself():
    """Reserved bytes are a staircase: a size between two measured ones is never read off a line, the card's own
    estimate runs (its search measures its edge)."""
    runs = {80: {1: 20 * GiB, 9: 68 * GiB, 10: 73 * GiB}, 48: {1: 20 * GiB, 4: 38 * GiB, 5: 44 * GiB},
            24: {1: 20 * GiB, 2: 22 * GiB}}
    calls = []

    def measure(seq, lever, card):
        calls.append(card // GiB)
        return runs[card // GiB], None

    cells = plan_cells([24 * GiB, 48 * GiB, 80 * GiB], [512], measure, fraction=0.9, cap=32, levers=(None,))
    assert [c.micro_batch for c in cells] == [1, 4, 9]
    assert calls == [80, 48, 24]


def test_the_calls_come_grouped_by_sequence_then_lever_largest_card_first():
    """One model on paper serves a (sequence, lever) group (`paper_session.OneAtATime` opens each once): per
    sequence, every card's estimate without the lever, then the lever's, largest card first, a key never back."""
    tables = {(s, None): {m: (10 + 20 * m) * GiB for m in range(1, 6)} for s in (512, 2048)}
    tables.update({(s, "all"): {m: (8 + 2 * m) * GiB for m in range(1, 11)} for s in (512, 2048)})
    measure, calls = _recording(tables)
    cells = plan_cells([24 * GiB, 32 * GiB, 80 * GiB], [2048, 512], measure, fraction=0.9, cap=8)
    # budgets 21.6, 28.8 and 72 GiB: 3 rows fit 80 GiB without the lever; 32 and 24 GiB need it (8, the cap, and 6)
    assert [(c.card_bytes // GiB, c.micro_batch, c.checkpointing) for c in cells][:3] == [
        (24, 6, "all"), (32, 8, "all"), (80, 3, "none")]
    keys = [(seq, lever) for seq, lever, _ in calls]
    assert keys == sorted(keys, key=lambda k: (k[0], k[1] is not None))  # grouped: no key comes back
    assert calls == [(512, None, 80), (512, "all", 32), (2048, None, 80), (2048, "all", 32)]


def test_decided_fit():
    assert fits.decided_fit({1: 5, 2: 9}, 8, 32) == 1
    assert fits.decided_fit({1: 9}, 8, 32) == 0
    assert fits.decided_fit({1: 5, 4: 7}, 8, 32) is None  # 5..: not measured
    assert fits.decided_fit({1: 5, 4: 7}, 8, 4) == 4  # the cap
    assert fits.decided_fit({}, 8, 4) is None


def test_the_grid_without_levers_tries_none():
    measure, calls = _recording({(512, None): {1: 30 * GiB}})
    cells = plan_cells([8 * GiB], [512], measure, fraction=0.9, cap=8, levers=(None,))
    assert calls == [(512, None, 8)]
    assert fits.cell_text(cells[0]) == "does not fit (40 GiB would)"


@pytest.mark.parametrize("cell, text", [
    (Cell(24 * GiB, 512, 3, "none"), "3"),
    (Cell(24 * GiB, 512, 32, "none", capped=True), "32+"),
    (Cell(24 * GiB, 512, 2, "all"), "2, checkpointing all layers"),
    (Cell(24 * GiB, 512, 1, "none", more=(5, "all", False)), "1 (5 checkpointing all layers)"),
    (Cell(24 * GiB, 512, 0, None, smallest_card_gib=80, needs="none"), "does not fit (80 GiB would)"),
    (Cell(24 * GiB, 512, 0, None, smallest_card_gib=40, needs="all"),
     "does not fit (40 GiB would, checkpointing all)"),
    (Cell(24 * GiB, 512, 0, None), "does not fit (none up to 141 GiB)"),
])
def test_cell_text(cell, text):
    assert fits.cell_text(cell) == text


def test_table_and_json():
    cells = [Cell(24 * GiB, 512, 3, "none"), Cell(80 * GiB, 512, 9, "none"),
             Cell(24 * GiB, 2048, 0, None, smallest_card_gib=40, needs="none"), Cell(80 * GiB, 2048, 2, "none")]
    assert fits.table(cells, [24 * GiB, 80 * GiB], [512, 2048]).splitlines() == [
        "| seq len | 24 GiB | 80 GiB |", "|---:|---|---|", "| 512 | 3 | 9 |",
        "| 2048 | does not fit (40 GiB would) | 2 |"]
    data = fits.to_json(cells, {"model": "m"})
    assert data["model"] == "m" and data["what_fits_where"] is True
    assert [(c["card_gib"], c["seq_len"], c["micro_batch"], c["fits"]) for c in data["cells"]] == [
        (24, 512, 3, True), (80, 512, 9, True), (24, 2048, 0, False), (80, 2048, 2, True)]
    assert fits.card_name(int(1.5 * GiB)) == "1.5 GiB" and fits.card_name(40 * MiB) == "40 MiB"


# --- the command, against one estimate per card ---------------------------------------------------------------
CARDS = ["40MiB", "80MiB", "200MiB"]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_table_is_each_cards_own_estimate(llama_folder, tmp_path, capsys, lora):
    """Every cell is the largest fit of that card's own estimate, at the checkpointing the cell names (a card too
    small without it: with every layer checkpointed; one too small either way: neither estimate fits micro-batch 1)."""
    from hf_accum import estimate
    from hf_accum.cli import main
    from hf_accum.probing.loop import NothingFitsError

    out = tmp_path / "fits.json"
    flags = ["--lora"] if lora else []
    code = main(["probe", "--estimate", "--model", llama_folder, "--device-memory", ",".join(CARDS),
                 "--seq-len", "64,512,2048", *flags, "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "| seq len | 40 MiB | 80 MiB | 200 MiB |" in text
    assert "for cuda" in text and "assumed: attention" in text  # a list of cards is a card-size question: CUDA
    assert "assumed: loss:" in text and "estimated in" in text
    data = json.loads(out.read_text())
    assert data["device"] == "cuda" and data["max_micro_batch"] == 32
    assert {"64/none", "512/none", "2048/none"} <= set(data["peaks"])
    cells = {(c["card_bytes"], c["seq_len"]): c for c in data["cells"]}
    assert len(cells) == 9 and len({c["micro_batch"] for c in cells.values()}) >= 4  # not one answer everywhere
    for card in CARDS:
        for seq in (64, 512, 2048):
            cell = cells[parse_size(card), seq]
            levers = [None, "all"] if cell["checkpointing"] is None else [
                None if cell["checkpointing"] == "none" else "all"]
            for lever in levers:
                kwargs = dict(seq_len=seq, target_batch_size=32, device="cuda", device_memory=card,
                              lora_r=8 if lora else None, all_peaks=False, checkpoint_layers=lever)
                if cell["checkpointing"] is None:
                    with pytest.raises(NothingFitsError):
                        estimate(llama_folder, **kwargs)
                else:
                    own = estimate(llama_folder, **kwargs)
                    assert cell["micro_batch"] == own.result.max_micro_batch_size, (card, seq, lever)


def test_one_value_each_keeps_the_single_estimate(llama_folder, capsys):
    from hf_accum.cli import main

    args = ["probe", "--estimate", "--model", llama_folder, "--device", "cpu", "--device-memory", "80MiB",
            "--seq-len", "64", "--target-batch", "4"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "predicted peak per micro-batch" in text and "what fits where" not in text


def test_a_seq_len_list_with_one_card_is_a_table_for_this_device(llama_folder, capsys):
    from hf_accum.cli import main

    assert main(["probe", "--estimate", "--model", llama_folder, "--device", "cpu", "--device-memory", "80MiB",
                 "--seq-len", "64,512", "--target-batch", "4"]) == 0
    text = capsys.readouterr().out
    assert "for cpu" in text and "| seq len | 80 MiB |" in text and "| 64 | 4+ |" in text
    assert "assumed: attention" not in text


@pytest.mark.parametrize("flags, words", [
    (["--seq-len", "64,512"], "--seq-len: a comma list is for --estimate"),
    (["--estimate", "--seq-len", "64,0"], "--seq-len=0 must be a positive integer"),
    (["--estimate", "--device-memory", "24GiB,80GiB", "--seq-len", "64,8192"],
     "--seq-len 8192 exceeds the model's max_position_embeddings=4096"),
    (["--estimate", "--device-memory", "24GiB,lots"], "--device-memory='lots'"),
    (["--estimate", "--device-memory", "24GiB,,80GiB"], "an empty value"),
    (["--estimate", "--device-memory", "24GiB,80GiB", "--budget-bytes", "100"], "--budget-bytes is one budget"),
    (["lora_sft", "--estimate", "--device-memory", "24GiB,80GiB"], "is for a bare model (--model)"),
])
def test_bad_lists_are_one_line(llama_folder, capsys, flags, words):
    from hf_accum.cli import main

    model = [] if flags[0] in ("--seq-len", "lora_sft") else ["--model", llama_folder]
    assert main(["probe", *model, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def test_a_seq_len_that_is_not_a_list_of_integers_is_a_usage_error(capsys):
    from hf_accum.cli import main

    assert main(["probe", "--estimate", "--seq-len", "64,x"]) == 2
    assert "--seq-len: '64,x': give an integer or a comma list such as 512,2048,8192" in capsys.readouterr().err


# --- once est41b's `quantization=` and est41c's `checkpoint_layers=` exist (issue 41 items 2 and 4) -------------
def test_qlora_table_passes_quantization_nf4(llama_folder, capsys):
    """--load-in-4bit: each estimate is of an NF4 base with LoRA adapters (needs `quantization=` in the estimate)."""
    from hf_accum.cli import main

    assert main(["probe", "--estimate", "--model", llama_folder, "--device-memory", ",".join(CARDS),
                 "--seq-len", "64,512", "--load-in-4bit"]) == 0
    text = capsys.readouterr().out
    assert "QLoRA (nf4 base, LoRA r=8)" in text and "| 512 |" in text


def test_the_checkpointing_lever_is_estimated_where_micro_batch_1_does_not_fit(deep_folder, tmp_path, capsys):
    """A card too small without checkpointing is read off the estimate with every layer checkpointed (needs
    `checkpoint_layers=` in the estimate)."""
    from hf_accum.cli import main

    kwargs = dict(seq_len=2048, card_bytes=200 * MiB, cap=32, target_batch_size=32, device="cuda", bf16=False,
                  fraction=0.9, lora_r=None, lora_target_modules=None, fused_loss=None, quantization=None)
    levered = fits.measure(deep_folder, checkpoint_layers="all", **kwargs)
    out = tmp_path / "fits.json"
    assert main(["probe", "--estimate", "--model", deep_folder, "--device-memory", "100MiB,200MiB,400MiB",
                 "--seq-len", "2048", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    # micro-batch 1 without checkpointing, as the grid stepped it for the 400 MiB card (a size's peak is the card's
    # own estimate's: tests/probing/test_paper_session.py), not a third estimate of the same step
    plain_one = data["peaks"]["2048/none"]["1"]
    assert levered.peaks[1] < 0.9 * 200 * MiB < plain_one
    cells = {(c["card_bytes"] // MiB, c["seq_len"]): c for c in data["cells"]}
    # 200 MiB: the lever's own estimate for that card
    assert (cells[200, 2048]["checkpointing"], cells[200, 2048]["micro_batch"]) == ("all", levered.largest)
    assert "checkpointing all layers" in capsys.readouterr().out
