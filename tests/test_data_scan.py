"""planning/data_scan.py: the one scan of the data (the probe's and the eval batch's longest example, preflight's
rows), and meters.format_bytes, the one byte formatter."""

from __future__ import annotations

import pytest
import torch

from hf_accum.meters import format_bytes
from hf_accum.planning.data_scan import example_length, is_sequence, longest_index, rows


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
