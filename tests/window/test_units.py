"""The cutting rules, as tables: unit detection, chunks of whole units, rebuilt padding-free metadata, exact-cut
verification, and where trimming is (not) allowed. Pure tensors, no model."""

import pytest
import torch
from transformers import DataCollatorWithFlattening

from hf_accum.window.loss import LabelSpec
from hf_accum.window.units import IndivisibleBatch, detect_unit, make_cutter, sliver

CAUSAL = LabelSpec(shift=True)


def flat(lengths, start=0, **kw):
    feats = [{"input_ids": list(range(10, 10 + n))} for n in lengths]
    return DataCollatorWithFlattening(position_ids_start=start, **kw)(feats)


def padded(lengths, width=None):
    width = width or max(lengths)
    ids = torch.tensor([[5] * n + [0] * (width - n) for n in lengths])
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("batch, unit", [
    (padded([3, 5]), "rows"),
    (flat([3, 4, 2]), "sequences"),
    (flat([3, 4], start=2), "sequences"),  # models whose positions start at padding_idx + 1
    (flat([3, 4], return_flash_attn_kwargs=True), "sequences"),
    (flat([6]), "rows"),  # one sequence: nothing to tell apart
])
def test_detect_unit(batch, unit):
    assert detect_unit(batch) == unit


@pytest.mark.parametrize("start", [0, 2])
def test_flattened_cut_at_sequence_starts_rebuilds_metadata(start):
    batch = flat([3, 4, 2, 5], start=start, return_flash_attn_kwargs=True, return_seq_idx=True)
    cutter = make_cutter("sequences", CAUSAL)
    assert cutter.units(batch) == 4
    chunks = cutter.cut(batch, 3, "tokens")
    assert [c["input_ids"].shape[1] for c in chunks] == [9, 5]
    first, second = chunks
    assert first["cu_seq_lens_q"].tolist() == [0, 3, 7, 9] and first["max_length_q"] == 4
    assert second["cu_seq_lens_k"].tolist() == [0, 5] and second["max_length_k"] == 5
    assert second["seq_idx"].tolist() == [[0] * 5]
    assert second["position_ids"].tolist() == [list(range(start, start + 5))]
    assert sum(int(cutter.count(c, "tokens")) for c in chunks) == int(cutter.count(batch, "tokens"))
    assert [int(cutter.count(c, "samples")) for c in chunks] == [3, 1]


def test_a_cut_that_changes_the_count_is_refused():
    batch = flat([3, 4, 2])
    batch["labels"] = batch["input_ids"].clone()  # sequence starts not masked: a label crosses each boundary
    with pytest.raises(IndivisibleBatch, match=r"changes its counted labels \(8 -> 6\)"):
        make_cutter("sequences", CAUSAL).cut(batch, 1, "tokens")


def test_pairs_go_with_their_rows_and_per_pair_tensors():
    chosen, rejected = padded([2, 3, 4]), padded([4, 1, 2])
    batch = {"input_ids": torch.cat([chosen["input_ids"], rejected["input_ids"]])}
    batch["attention_mask"] = torch.cat([chosen["attention_mask"], rejected["attention_mask"]])
    batch["completion_mask"] = batch["attention_mask"].clone()
    batch["ref_chosen_logps"] = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)
    batch["ref_rejected_logps"] = torch.tensor([1.1, 1.2, 1.3], dtype=torch.float64)
    cutter = make_cutter("pairs", LabelSpec())
    chunks = cutter.cut(batch, 2, "samples")
    assert [cutter.units(c) for c in chunks] == [2, 1]
    # pair 0 = rows 0 and 3, pair 1 = rows 1 and 4
    assert chunks[0]["attention_mask"].sum(1).tolist() == [2, 3, 4, 1]
    assert chunks[0]["ref_rejected_logps"].tolist() == [1.1, 1.2]
    assert chunks[1]["attention_mask"].sum(1).tolist() == [4, 2] and chunks[1]["ref_chosen_logps"].tolist() == [0.3]
    assert chunks[1]["input_ids"].shape[1] == 4  # trimmed to its own padding (per-token completion_mask)


def test_a_tensor_that_follows_no_unit_is_indivisible():
    batch = padded([3, 5, 2, 4])
    batch["prototypes"] = torch.zeros(3, 8)  # 3 entries for 4 rows: no idea how to cut it
    with pytest.raises(IndivisibleBatch, match="'prototypes' has 3 entries along dim 0 but the batch has 4 rows"):
        make_cutter("rows", CAUSAL).cut(batch, 2)
    with pytest.raises(IndivisibleBatch, match="even number"):
        make_cutter("pairs", LabelSpec()).units(padded([3, 5, 2]))
    packed_rows = flat([3, 4])
    packed_rows = {k: v.repeat(2, 1) if torch.is_tensor(v) and v.dim() == 2 else v for k, v in packed_rows.items()}
    with pytest.raises(IndivisibleBatch, match="cannot cut packed rows"):
        make_cutter("sequences", CAUSAL).units(packed_rows)


def test_trim_only_where_padding_provably_takes_no_part():
    tokens = make_cutter("rows", CAUSAL).cut(padded([2, 6, 3, 3]), 2)
    assert [c["input_ids"].shape[1] for c in tokens] == [6, 3]
    # extractive QA: per-sample labels, the span softmax runs over every position: widths kept
    qa = padded([2, 6, 3, 3])
    qa = {"input_ids": qa["input_ids"], "attention_mask": qa["attention_mask"],
          "start_positions": torch.tensor([0, 1, 2, 0]), "end_positions": torch.tensor([1, 4, 2, 2])}
    chunks = make_cutter("rows", LabelSpec(key="start_positions")).cut(qa, 2)
    assert [c["input_ids"].shape[1] for c in chunks] == [6, 6]


def test_labels_with_another_ignore_index_are_counted_by_it():
    labels = torch.tensor([[1, 255, 2], [255, 255, 0]])
    assert int(LabelSpec(ignore_index=255).count({"labels": labels})) == 3
    assert int(LabelSpec(key="my_labels").count({"my_labels": labels, "labels": torch.zeros(1)})) == 6


@pytest.mark.parametrize("unit, batch", [("rows", padded([3, 5])), ("sequences", flat([3, 4], return_flash_attn_kwargs=True))])
def test_sliver_is_one_unit_two_tokens(unit, batch):
    s = sliver(batch, unit)
    assert s["input_ids"].shape == (1, 2)
    if unit == "sequences":
        assert s["cu_seq_lens_q"].tolist() == [0, 2] and s["max_length_q"] == 2


# --- near-equal forwards (the plan's cut of a window loaded whole) ---------------------------------------------
@pytest.mark.parametrize("lengths, max_units, groups, rows_per_chunk, widths", [
    ([3, 9, 4, 8, 2, 7, 5], 3, None, [[1, 3], [5, 6], [0, 2, 4]], [9, 7, 4]),  # 3 forwards of 2, 2, 3; longest first
    ([4] * 7, 7, None, [[0, 1, 2, 3, 4, 5, 6]], [4]),  # fits in one forward: the batch as it is
    ([4] * 6, 2, None, [[0, 1], [2, 3], [4, 5]], [4, 4, 4]),  # equal lengths keep their order
    ([5, 1, 3], 3, 2, [[0], [1, 2]], [5, 3]),  # the ranks agreed on 2 forwards: one more than this rank needs
])
def test_cut_near_equal_puts_the_longest_rows_together(lengths, max_units, groups, rows_per_chunk, widths):
    batch = padded(lengths)
    batch["row"] = torch.arange(len(lengths))
    cutter = make_cutter("rows", CAUSAL)
    chunks = cutter.cut_near_equal(batch, max_units, groups, "tokens")
    assert [c["row"].tolist() for c in chunks] == rows_per_chunk
    assert [c["input_ids"].shape[1] for c in chunks] == widths  # each chunk trimmed to its own longest row
    assert sum(int(cutter.count(c, "tokens")) for c in chunks) == int(cutter.count(batch, "tokens"))


def test_cut_near_equal_keeps_pairs_and_sequences_whole():
    chosen, rejected = padded([2, 6, 4]), padded([3, 5, 6])
    pairs = {k: torch.cat([chosen[k], torch.nn.functional.pad(rejected[k], (0, 0))]) for k in chosen}
    pairs["ref_chosen_logps"] = torch.tensor([0.0, 1.0, 2.0])
    cutter = make_cutter("pairs", CAUSAL)
    chunks = cutter.cut_near_equal(pairs, 2, None, "tokens")
    # pair lengths (the longer row): 3, 6, 6 -> 2 forwards of 1 and 2 pairs, the longest pair in the smaller one
    assert [c["ref_chosen_logps"].tolist() for c in chunks] == [[1.0], [0.0, 2.0]]
    assert chunks[0]["input_ids"].shape[0] == 2 and chunks[1]["input_ids"].shape[0] == 4
    assert chunks[0]["input_ids"].tolist() == [[5] * 6, [5] * 5 + [0]]  # chosen 1 with rejected 1
    flat_batch = flat([3, 4, 2, 5, 1])
    seqs = make_cutter("sequences", CAUSAL)
    parts = seqs.cut_near_equal(flat_batch, 2, None, "tokens")
    assert [int(seqs.count(c, "samples")) for c in parts] == [1, 2, 2]  # in order, 5 sequences in 3 forwards
    assert sum(int(seqs.count(c, "tokens")) for c in parts) == int(seqs.count(flat_batch, "tokens"))


@pytest.mark.parametrize("unit, build", [
    ("rows", lambda: padded([3, 7, 5, 2])),
    ("pairs", lambda: padded([3, 7, 5, 2])),
    ("sequences", lambda: flat([3, 4, 2, 5], return_flash_attn_kwargs=True)),
])
def test_every_tensor_a_cut_makes_stays_on_the_batch_device(unit, build, monkeypatch):
    """On CUDA the batch arrives on the GPU; a tensor the cutter made on the CPU beside it crashed every cut window
    there (bench_gpu on an H100: `positions` in `Cutter.lengths`). CPU-only stand-in: tensors made without an
    explicit device land on 'meta', and mixing them with the batch's CPU tensors raises."""
    batch = build()
    cutter = make_cutter(unit, CAUSAL)
    torch.set_default_device("meta")
    try:
        lengths = cutter.lengths(batch)
        near = cutter.cut_near_equal(batch, 1, None, "tokens")
        tokens = cutter.cut_by_tokens(batch, max(lengths), None, "tokens")
        counts = [int(cutter.count(c, "samples")) for c in near]
        one = sliver(batch, unit)
    finally:
        torch.set_default_device("cpu")
    assert len(near) == cutter.units(batch) and counts == [1] * len(near)
    assert len(tokens) >= 1 and sum(cutter.units(c) for c in tokens) == cutter.units(batch)
    assert cutter.units(one) == 1
