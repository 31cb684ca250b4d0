"""Reserved, not only allocated: the caching allocator's rules as a pure function (`probing/reserved.py`), table-tested
with allocation sequences whose reserved bytes follow from PyTorch's rules (the `gpu` test replays the same table on a
real card), and the estimate for CUDA fitting by the reserved bytes they predict."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hf_accum.probing.reserved import (
    CachingAllocator,
    expandable_from_env,
    replay,
    round_size,
    segment_size,
)

KiB, MiB = 2**10, 2**20


def m(key, nbytes):
    return ("malloc", key, nbytes)


def f(key):
    return ("free", key, 0)


EMPTY = ("empty_cache", None, 0)

# (name, events, expandable, reserved at the end, peak reserved)
TABLE = [
    ("one byte: a 2 MiB small segment", [m(1, 1)], False, 2 * MiB, 2 * MiB),
    ("small requests share a small segment", [m(1, 100), m(2, MiB)], False, 2 * MiB, 2 * MiB),
    ("a small pool does not serve a large request", [m(1, 100), m(2, 2 * MiB)], False, 22 * MiB, 22 * MiB),
    ("under 10 MiB: a 20 MiB segment, split while > 1 MiB is left",
     [m(k, 5 * MiB) for k in range(5)], False, 40 * MiB, 40 * MiB),
    ("from 10 MiB: the request rounded up to 2 MiB", [m(1, 11 * MiB)], False, 12 * MiB, 12 * MiB),
    ("a cached block too small for the next request stays reserved",
     [m(1, 12 * MiB), f(1), m(2, 12 * MiB + 1)], False, 26 * MiB, 26 * MiB),
    ("empty_cache releases a wholly free segment", [m(1, 12 * MiB), f(1), EMPTY, m(2, 12 * MiB + 1)], False,
     14 * MiB, 14 * MiB),
    ("a freed block is reused (best fit) before a new segment", [m(1, 12 * MiB), m(2, 4 * MiB), f(1), m(3, 12 * MiB)],
     False, 32 * MiB, 32 * MiB),
    ("a cached block serves requests one after another", [m(1, 12 * MiB), f(1), m(2, 4 * MiB), m(3, 4 * MiB)],
     False, 12 * MiB, 12 * MiB),
    ("neighbours merge when freed", [m(1, 5 * MiB), m(2, 5 * MiB), f(1), f(2), m(3, 15 * MiB)], False,
     20 * MiB, 20 * MiB),
    ("a live block keeps its segment through empty_cache", [m(1, 5 * MiB), m(2, 5 * MiB), f(1), EMPTY], False,
     20 * MiB, 20 * MiB),
    ("expandable: large pages of 20 MiB", [m(1, 5 * MiB)], True, 20 * MiB, 20 * MiB),
    ("expandable: small pages of 2 MiB", [m(1, 100)], True, 2 * MiB, 2 * MiB),
    ("expandable: the segment grows where fixed segments would add one", [m(k, 5 * MiB) for k in range(5)], True,
     40 * MiB, 40 * MiB),
    ("expandable: a free tail is grown into, not left behind", [m(1, 12 * MiB), f(1), m(2, 30 * MiB)], True,
     40 * MiB, 40 * MiB),
    ("expandable: empty_cache unmaps the whole free pages only",
     [m(1, 30 * MiB), m(2, MiB + 512), f(1), EMPTY], True, 20 * MiB, 40 * MiB),
    ("expandable: 12 MiB needs one 20 MiB page where fixed segments take 12 MiB", [m(1, 12 * MiB)], True,
     20 * MiB, 20 * MiB),
]


@pytest.mark.parametrize("name, events, expandable, reserved, peak", TABLE, ids=[row[0] for row in TABLE])
def test_reserved_bytes_follow_the_allocator_rules(name, events, expandable, reserved, peak):
    assert replay(events, expandable=expandable) == (reserved, peak)


@pytest.mark.parametrize("nbytes, rounded", [(0, 512), (1, 512), (512, 512), (513, 1024), (MiB + 1, MiB + 512)])
def test_round_size(nbytes, rounded):
    assert round_size(nbytes) == rounded


@pytest.mark.parametrize("rounded, segment", [(512, 2 * MiB), (MiB, 2 * MiB), (MiB + 512, 20 * MiB),
                                              (10 * MiB - 512, 20 * MiB), (10 * MiB, 10 * MiB),
                                              (10 * MiB + 512, 12 * MiB)])
def test_segment_size(rounded, segment):
    assert segment_size(rounded) == segment


def test_allocated_counts_blocks_and_an_empty_storage_nothing():
    allocator = CachingAllocator()
    allocator.malloc("empty", 0)
    allocator.malloc("a", 100)
    allocator.malloc("b", 11 * MiB + 512)
    allocator.malloc("c", 600 * KiB)  # the small pool: beside "a" in its 2 MiB segment
    # "b" takes its whole 12 MiB segment: the 1 MiB - 512 left is not worth a block in the large pool
    assert allocator.allocated == 512 + 12 * MiB + 600 * KiB
    allocator.free("a")
    allocator.free("never")
    assert allocator.allocated == 12 * MiB + 600 * KiB and allocator.reserved == 2 * MiB + 12 * MiB


@pytest.mark.parametrize("environ, expandable", [
    ({}, True),  # hf_accum sets expandable_segments:True when the variable is unset
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments : true"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, False),
])
def test_which_allocator_the_run_has(environ, expandable):
    assert expandable_from_env(environ) is expandable


# --- the estimate for CUDA fits by reserved bytes ----------------------------------------------------------------
def _llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("expandable", [False, True])
def test_the_cuda_estimate_fits_by_reserved_bytes_and_says_so(monkeypatch, expandable):
    from hf_accum.probing.estimate import estimate_model

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", f"expandable_segments:{expandable}")
    est = estimate_model(_llama, seq_len=128, target_batch_size=16, device="cuda", device_memory=2**30,
                         budget_bytes=80 * MiB)
    trials = [t for t in est.result.trials if t.peak_bytes is not None]
    assert trials and all(t.reserved_bytes >= t.peak_bytes for t in trials)
    assert any(t.reserved_bytes > t.peak_bytes for t in trials)  # segments round up: reserved is more
    fits = [t for t in trials if t.fits]
    assert all(t.reserved_bytes <= est.result.budget_bytes for t in fits)
    assert all(t.reserved_bytes > est.result.budget_bytes for t in trials if not t.fits)
    said = [line for line in est.assumptions if line.startswith("reserved bytes modelled")]
    assert len(said) == 1 and ("expandable segments" in said[0]) is expandable
    assert est.to_json()["reserved"] == "allocator model"


def test_the_cpu_estimate_has_no_reserved_bytes():
    from hf_accum.probing.estimate import estimate_model

    est = estimate_model(_llama, seq_len=32, target_batch_size=2, device="cpu", device_memory=2**30,
                         budget_bytes=64 * MiB)
    assert all(t.reserved_bytes is None for t in est.result.trials)
    assert est.to_json()["reserved"] is None


# --- on a real card: the same table, replayed by torch's own allocator --------------------------------------------
_REPLAY = """
import json, sys, torch
events = json.loads(sys.argv[1])
live = {}
torch.cuda.init()
base = torch.cuda.memory_reserved()
torch.cuda.reset_peak_memory_stats()
for op, key, nbytes in events:
    if op == "malloc":
        live[key] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    elif op == "free":
        del live[key]
    else:
        torch.cuda.empty_cache()
print(json.dumps([torch.cuda.memory_reserved() - base, torch.cuda.max_memory_reserved() - base]))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("name, events, expandable, reserved, peak", TABLE, ids=[row[0] for row in TABLE])
def test_the_table_is_what_a_real_card_reserves(name, events, expandable, reserved, peak):
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:{expandable}"}
    out = subprocess.run([sys.executable, "-c", _REPLAY, json.dumps(events)], env=env, capture_output=True,
                         text=True, check=True)
    assert tuple(json.loads(out.stdout.strip().splitlines()[-1])) == (reserved, peak)


_WHOLE_SEGMENT_MERGE = CachingAllocator._merge


class _FullScan(CachingAllocator):
    """The allocator merging the freed block's whole segment, as before the merge went local: the reference."""

    def _merge_around(self, pool, blocks, block):
        pool.add(block)
        self._merge(pool, blocks)


def _state(allocator):
    return (allocator.reserved, allocator.peak_reserved, allocator.allocated,
            {small: {sid: [(b.offset, b.size, b.state) for b in blocks] for sid, blocks in pool.segments.items()}
             for small, pool in allocator.pools.items()})


@pytest.mark.parametrize("expandable", [False, True])
def test_a_free_merges_only_its_neighbours_and_ends_as_the_whole_segment_scan(expandable, monkeypatch):
    """A free merges the freed block with its neighbours alone (a 32-layer step frees ~20,000 times: a scan of the
    segment each time was most of the estimate's allocator time), with the state a scan of the whole segment gives,
    after every one of 400 random mallocs, frees and empty_caches, in both pools."""
    import random

    rng = random.Random(0)
    ours, reference = CachingAllocator(expandable), _FullScan(expandable)
    scans = []
    monkeypatch.setattr(CachingAllocator, "_merge", lambda self, pool, blocks: (
        scans.append(len(blocks)), _WHOLE_SEGMENT_MERGE(self, pool, blocks)))
    live = []
    for step in range(400):
        r = rng.random()
        if r < 0.5 or not live:
            nbytes = rng.choice([rng.randint(1, 4096), rng.randint(1, 2 * MiB), rng.randint(MiB, 200 * MiB)])
            for a in (ours, reference):
                a.malloc(step, nbytes)
            live.append(step)
        elif r < 0.97:
            key = live.pop(rng.randrange(len(live)))
            before = len(scans)
            ours.free(key)
            assert len(scans) == before  # no scan of the segment for our free
            reference.free(key)
        else:
            for a in (ours, reference):
                a.empty_cache()
        assert _state(ours) == _state(reference), step



class _ScanFit(CachingAllocator):
    """Best fit by a scan of every block of the pool, as before the free blocks were kept sorted: the reference."""

    def _best_fit(self, pool, size):
        best = None
        for blocks in pool.segments.values():
            for b in blocks:
                if b.state == "free" and b.size >= size and (best is None or b.size < best.size):
                    best = b
        return best


def _indexed_free_blocks_are_the_free_blocks(allocator):
    for pool in allocator.pools.values():
        free = sorted((b.size, b.segment, b.offset) for blocks in pool.segments.values() for b in blocks
                      if b.state == "free")
        assert pool.free == free and all(pool.by_key[k].state == "free" for k in free)


@pytest.mark.parametrize("expandable", [False, True])
def test_best_fit_from_the_sorted_free_blocks_is_the_scans_choice(expandable):
    """The free blocks kept sorted by (size, segment, offset) give the block a scan of every block picks (the
    smallest that holds the request; ties: the oldest segment, the lowest offset): the same state after each of 600
    random mallocs (many of equal sizes, so ties happen), frees and empty_caches."""
    import random

    rng = random.Random(1)
    ours, reference = CachingAllocator(expandable), _ScanFit(expandable)
    live = []
    for step in range(600):
        r = rng.random()
        if r < 0.55 or not live:
            nbytes = rng.choice([rng.choice([512, 4096, 3 * MiB, 12 * MiB]), rng.randint(1, 2 * MiB),
                                 rng.randint(MiB, 60 * MiB)])
            for a in (ours, reference):
                a.malloc(step, nbytes)
            live.append(step)
        elif r < 0.96:
            key = live.pop(rng.randrange(len(live)))
            for a in (ours, reference):
                a.free(key)
        else:
            for a in (ours, reference):
                a.empty_cache()
        assert _state(ours) == _state(reference), step
        _indexed_free_blocks_are_the_free_blocks(ours)
