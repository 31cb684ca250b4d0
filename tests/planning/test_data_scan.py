"""planning/data_scan.py: the one scan of the data (the probe's and the eval batch's longest example, preflight's
rows), and meters.format_bytes, the one byte formatter."""

from __future__ import annotations

import pytest
import torch

from hf_accum.planning.data_scan import example_length, is_sequence, longest_index, rows
from hf_accum.probing.meters import format_bytes


@pytest.mark.parametrize("example, length", [
    ({"input_ids": [1, 2, 3], "labels": [1, 2, 3, 4, 5]}, 3),  # input_ids first
    ({"inputs_embeds": torch.zeros(4, 8)}, 4),
    ({"other": [1, 2], "text": "a long string is not a sequence of tokens"}, 2),
    ([5, 6, 7, 8], 4),
    (7, 0),
])
def test_example_length(example, length):
    assert example_length(example) == length


def test_longest_index_is_the_first_of_equals():
    assert longest_index([3, 9, 2, 9]) == 1 and longest_index([1]) == 0


def test_rows_yields_the_rows_that_have_every_key():
    data = [{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3]}, {"input_ids": [], "labels": []}]
    assert list(rows(data)) == [(0, [1, 2], [1, 2]), (2, [], [])]
    assert list(rows(data, ("input_ids",))) == [(0, [1, 2]), (1, [3]), (2, [])]


def test_rows_reads_a_datasets_dataset_by_columns():
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]], "labels": [[1, 2], [3]]})
    assert list(rows(data)) == [(0, [1, 2], [1, 2]), (1, [3], [3])]
    assert list(rows(data, ("input_ids", "missing"))) == []


@pytest.mark.parametrize("value, expected", [([1], True), (torch.zeros(3), True), (torch.zeros(2, 2), False),
                                             ("abc", False), (b"ab", False), (3, False)])
def test_is_sequence(value, expected):
    assert is_sequence(value) is expected


@pytest.mark.parametrize("n, unit, expected", [
    (None, None, "?"),
    (64 * 2**20, None, "64.0 MiB"),
    (int(1.86 * 2**30), None, "1.860 GiB"),
    (-3 * 2**30, None, "-3.000 GiB"),
    (1234.5 * 2**20, "MiB", "1,234.5"),
])
def test_format_bytes(n, unit, expected):
    assert format_bytes(n, unit) == expected
    assert format_bytes(None, unit, none="-") == "-"


# --- the probe's rows (planning/probe_rows.py) ------------------------------------------------------------------
def test_a_0_d_tensor_is_no_sequence():
    example = {"input_x": torch.tensor(0.5), "labels": torch.tensor(1.5)}  # a datasets row in torch format
    assert example_length(example) == 0


def test_a_packed_row_loses_its_last_token_with_its_last_sequence():
    from hf_accum.planning.probe_rows import trimmed

    row = {"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [3, 2], "position_ids": [0, 1, 2, 0, 1], "tag": "x"}
    assert trimmed(row, 5) == {"input_ids": [1, 2, 3, 4], "seq_lengths": [3, 1], "position_ids": [0, 1, 2, 0],
                               "tag": "x"}
    assert trimmed({"input_ids": [1, 2, 3], "seq_lengths": [2, 1]}, 3) == {"input_ids": [1, 2], "seq_lengths": [2]}


def test_a_packed_row_made_consistent_stays_one_the_trl_collator_takes():
    trl = pytest.importorskip("trl")
    from hf_accum.planning.probe_rows import probe_rows

    collator = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    row = {"input_ids": list(range(1, 9)), "seq_lengths": [5, 3]}
    batch = collator(probe_rows(row, pads=True)(3))
    assert batch["input_ids"].shape == (1, 23) and batch["position_ids"][0].tolist()[-7:] == [0, 1, 2, 3, 4, 0, 1]


def test_stretched_repeats_each_sequence_out_to_the_bound():
    from hf_accum.planning.probe_rows import stretched

    row = {"prompt_ids": [7, 8], "chosen_ids": torch.tensor([1, 2, 3]), "seq_lengths": [2, 1], "input_ids": [4, 5, 6]}
    out = stretched(row, 7)
    assert out["prompt_ids"] == [7, 8, 7, 8, 7, 8, 7] and out["chosen_ids"].tolist() == [1, 2, 3, 1, 2, 3, 1]
    assert out["input_ids"] == [4, 5, 6, 4, 5, 6, 4] and out["seq_lengths"] == [2, 5]


@pytest.mark.parametrize("name, pads", [("default_data_collator", False), ("DefaultDataCollator", False),
                                        ("DataCollatorWithFlattening", False), ("DataCollatorWithPadding", True),
                                        ("DataCollatorForSeq2Seq", True)])
def test_whether_a_collator_pads_is_known_from_its_type(name, pads):
    import transformers

    from hf_accum import tiny
    from hf_accum.planning.probe_rows import known_to_pad

    obj = getattr(transformers, name)
    collator = obj if name == "default_data_collator" else obj() if "Default" in name or "Flat" in name \
        else obj(tiny.build_tokenizer())
    assert known_to_pad(collator) is pads
    assert known_to_pad(torch.utils.data.default_collate) is False and known_to_pad(lambda rows: rows) is None


def test_an_unknown_collator_pads_where_it_takes_rows_of_different_lengths_and_masks_them():
    from hf_accum.planning.probe_rows import collate_pads
    from tests.exactness import pad_collate

    short, long = {"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [1, 2, 3], "labels": [1, 2, 3]}
    assert collate_pads(pad_collate, [long, short]) is True
    assert collate_pads(lambda rows: {"input_ids": torch.tensor([r["input_ids"] for r in rows])}, [long, short]) is False
