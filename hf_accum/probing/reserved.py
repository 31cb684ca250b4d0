"""What the CUDA caching allocator reserves for a sequence of allocations: the bytes the probe fits by on a GPU
(``torch.cuda.max_memory_reserved``), where the estimate's fake tensors only give the bytes allocated.

A pure model of PyTorch's rules (c10/cuda/CUDACachingAllocator.cpp), one stream, no memory pressure:

- every request is rounded up to a multiple of 512 bytes (`round_size`);
- requests of at most 1 MiB come from the small pool, larger ones from the large pool;
- a request is served by the smallest cached free block of its pool that holds it (best fit; ties: the oldest
  segment, the lowest offset), split when what is left is worth keeping (small pool: >= 512 bytes; large pool:
  > 1 MiB; with expandable segments: >= 512 bytes in both);
- with none, a new segment is reserved (`segment_size`): 2 MiB for the small pool, 20 MiB for a request under
  10 MiB, else the request rounded up to 2 MiB. With ``expandable_segments:True`` (what hf_accum sets, see
  `hf_accum.compat.allocator`) each pool has one segment that grows in pages instead (2 MiB small, 20 MiB large), mapped
  after its last free block;
- a freed block merges with free neighbours in its segment and stays reserved (cached) until `empty_cache`, which
  releases whole free segments (expandable: the free pages).

The probe's CUDA meter empties the cache before each trial, so a step's reserved peak is the segments its own
allocations leave, on top of those holding the weights, gradients and optimizer state. Under memory pressure the
real allocator frees cached segments and retries, so the model is an upper bound there.
"""

from __future__ import annotations

import os
from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass, field

KiB, MiB = 2**10, 2**20
MIN_BLOCK = 512  # kMinBlockSize: every block a multiple of it
SMALL_SIZE = 1 * MiB  # kSmallSize: the largest request the small pool serves
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: a small-pool segment (and an expandable small segment's page)
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: the segment for a request under MIN_LARGE_ALLOC (and a large page)
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: from here, a segment is the request rounded up to ROUND_LARGE
ROUND_LARGE = 2 * MiB  # kRoundLarge


def round_size(nbytes: int) -> int:
    """A request as a block: at least 512 bytes, a multiple of 512."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(rounded: int) -> int:
    """The segment reserved for a (rounded) request no cached block holds (fixed-size segments)."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


def expandable_from_env(environ=os.environ) -> bool:
    """Whether the run's allocator grows segments in place: ``PYTORCH_CUDA_ALLOC_CONF`` as set, or hf_accum's default
    (`hf_accum.compat.allocator` sets ``expandable_segments:True`` when the variable is unset)."""
    from ..compat.allocator import SETTING, VARIABLE

    conf = environ.get(VARIABLE, SETTING).replace(" ", "").lower()
    return "expandable_segments:true" in conf


@dataclass(eq=False)  # a block is itself: found in its segment's list by identity (`list.index`), never by fields
class _Block:
    segment: int
    offset: int
    size: int
    state: str = "free"  # "free", "used", or "unmapped" (an expandable segment's pages not mapped)


@dataclass
class _Pool:
    small: bool
    segments: dict[int, list[_Block]] = field(default_factory=dict)  # segment id -> its blocks by offset
    # the free blocks by (size, segment, offset): best fit is a bisection, not a scan of every block (a 32-layer
    # step allocates ~35,000 times); its order is the scan's (the smallest, then the oldest segment, lowest offset)
    free: list[tuple[int, int, int]] = field(default_factory=list)
    by_key: dict[tuple[int, int, int], _Block] = field(default_factory=dict)

    def add(self, block: _Block) -> None:
        key = (block.size, block.segment, block.offset)
        insort(self.free, key)
        self.by_key[key] = block

    def drop(self, block: _Block) -> None:
        key = (block.size, block.segment, block.offset)
        del self.free[bisect_left(self.free, key)]
        del self.by_key[key]


class CachingAllocator:
    """The allocator's bookkeeping for one stream: ``malloc(key, nbytes)``, ``free(key)``, ``empty_cache()``;
    ``reserved`` (bytes held from the device now), ``peak_reserved`` since `reset_peak`, ``allocated`` (the blocks
    in use, each its rounded size or the whole block when not split)."""

    def __init__(self, expandable: bool = False) -> None:
        self.expandable = expandable
        self.pools = {True: _Pool(True), False: _Pool(False)}
        self.live: dict[object, _Block] = {}
        self.reserved = 0
        self.peak_reserved = 0
        self.allocated = 0
        self._next_segment = 0

    # -- the interface -------------------------------------------------------------------------------------------
    def malloc(self, key: object, nbytes: int) -> None:
        if nbytes <= 0 or key in self.live:  # torch allocates nothing for an empty storage
            return
        size = round_size(nbytes)
        pool = self.pools[size <= SMALL_SIZE]
        block = self._best_fit(pool, size)
        if block is None:
            block = self._grow(pool, size)
        self._take(pool, block, size)
        self.live[key] = block
        self.allocated += block.size

    def free(self, key: object) -> None:
        block = self.live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.state = "free"
        pool = self.pools[self._pool_of(block)]
        self._merge_around(pool, pool.segments[block.segment], block)

    def empty_cache(self) -> None:
        """Release what is cached: every segment wholly free (expandable: every whole free page)."""
        for pool in self.pools.values():
            for sid, blocks in list(pool.segments.items()):
                if self.expandable:
                    self._unmap_free_pages(pool, blocks)
                elif len(blocks) == 1 and blocks[0].state == "free":
                    pool.drop(blocks[0])
                    self.reserved -= blocks[0].size
                    del pool.segments[sid]

    def reset_peak(self) -> None:
        self.peak_reserved = self.reserved

    # -- the rules -----------------------------------------------------------------------------------------------
    def _pool_of(self, block: _Block) -> bool:
        return block.segment in self.pools[True].segments

    def _page(self, pool: _Pool) -> int:
        return SMALL_BUFFER if pool.small else LARGE_BUFFER

    def _best_fit(self, pool: _Pool, size: int) -> _Block | None:
        i = bisect_left(pool.free, (size, -1, -1))
        return pool.by_key[pool.free[i]] if i < len(pool.free) else None

    def _grow(self, pool: _Pool, size: int) -> _Block:
        """A new fixed-size segment, or more pages mapped at the end of the pool's expandable segment."""
        if not self.expandable:
            total = segment_size(size)
            sid = self._new_segment()
            block = _Block(sid, 0, total)
            pool.segments[sid] = [block]
            pool.add(block)
            self._reserve(total)
            return block
        if not pool.segments:  # one segment per pool, its last block the unbounded unmapped rest
            sid = self._new_segment()
            pool.segments[sid] = [_Block(sid, 0, 0, "unmapped")]
        sid, blocks = next(iter(pool.segments.items()))
        page = self._page(pool)
        # the first unmapped run that, with the free block before it, holds the request; pages are mapped to cover
        # what the free block lacks, and the two merge
        for i, b in enumerate(blocks):
            if b.state != "unmapped":
                continue
            tail = i == len(blocks) - 1
            before = blocks[i - 1] if i > 0 and blocks[i - 1].state == "free" else None
            have = before.size if before is not None else 0
            if not tail and have + b.size < size:
                continue
            mapped = -(-(size - have) // page) * page
            if not tail:
                mapped = min(mapped, b.size)
            new = _Block(sid, b.offset, mapped)
            blocks.insert(i, new)
            pool.add(new)
            b.offset += mapped
            if not tail:
                b.size -= mapped
                if b.size == 0:
                    blocks.remove(b)
            self._reserve(mapped)
            self._merge(pool, blocks)
            return before if before is not None else new
        raise AssertionError("an expandable segment always ends unmapped")  # pragma: no cover

    def _take(self, pool: _Pool, block: _Block, size: int) -> None:
        """Use ``block`` for a request of ``size``, splitting off the rest when it is worth keeping."""
        remaining = block.size - size
        split = remaining >= MIN_BLOCK if (pool.small or self.expandable) else remaining > SMALL_SIZE
        pool.drop(block)
        if split:
            blocks = pool.segments[block.segment]
            rest = _Block(block.segment, block.offset + size, remaining)
            blocks.insert(blocks.index(block) + 1, rest)
            pool.add(rest)
            block.size = size
        block.state = "used"

    def _merge(self, pool: _Pool, blocks: list[_Block]) -> None:
        i = 0
        while i < len(blocks) - 1:
            a, b = blocks[i], blocks[i + 1]
            if a.state == b.state and a.state in ("free", "unmapped"):
                if a.state == "free":
                    pool.drop(a)
                    pool.drop(b)
                a.size += b.size
                del blocks[i + 1]
                if a.state == "free":
                    pool.add(a)
            else:
                i += 1

    def _merge_around(self, pool: _Pool, blocks: list[_Block], block: _Block) -> None:
        """`_merge` after ``block`` alone was freed: every other op leaves no two neighbours both free (or both
        unmapped), so only ``block``'s neighbours can merge, and a whole-segment scan per free (most of a
        32-layer step's allocator time) finds the same."""
        i = blocks.index(block)
        if i + 1 < len(blocks) and blocks[i + 1].state == "free":
            pool.drop(blocks[i + 1])
            block.size += blocks[i + 1].size
            del blocks[i + 1]
        if i > 0 and blocks[i - 1].state == "free":
            pool.drop(blocks[i - 1])
            blocks[i - 1].size += block.size
            del blocks[i]
            block = blocks[i - 1]
        pool.add(block)

    def _unmap_free_pages(self, pool: _Pool, blocks: list[_Block]) -> None:
        page = self._page(pool)
        out: list[_Block] = []
        for b in blocks:
            if b.state == "free":
                pool.drop(b)
            if b.state != "free":
                out.append(b)
                continue
            start, end = -(-b.offset // page) * page, (b.offset + b.size) // page * page
            if end <= start:
                out.append(b)
                continue
            if start > b.offset:
                out.append(_Block(b.segment, b.offset, start - b.offset))
            out.append(_Block(b.segment, start, end - start, "unmapped"))
            if b.offset + b.size > end:
                out.append(_Block(b.segment, end, b.offset + b.size - end))
            self.reserved -= end - start
        if out and out[-1].state != "unmapped":
            out.append(_Block(out[-1].segment, out[-1].offset + out[-1].size, 0, "unmapped"))
        blocks[:] = out
        for b in blocks:
            if b.state == "free":
                pool.add(b)
        self._merge(pool, blocks)

    def _new_segment(self) -> int:
        self._next_segment += 1
        return self._next_segment

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)


def replay(events: Iterable[tuple[str, object, int]], *, expandable: bool = False) -> tuple[int, int]:
    """``(reserved at the end, peak reserved)`` after ``events``: ("malloc", key, nbytes), ("free", key, 0) or
    ("empty_cache", None, 0), in order, from an empty allocator."""
    allocator = CachingAllocator(expandable)
    for op, key, nbytes in events:
        if op == "malloc":
            allocator.malloc(key, nbytes)
        elif op == "free":
            allocator.free(key)
        elif op == "empty_cache":
            allocator.empty_cache()
        else:
            raise ValueError(f"event {op!r}: give malloc, free or empty_cache")
    return allocator.reserved, allocator.peak_reserved


def describe(expandable: bool) -> str:
    """The estimate's line saying how reserved bytes are predicted."""
    how = ("expandable segments (PYTORCH_CUDA_ALLOC_CONF expandable_segments:True: pages of 2 MiB small / 20 MiB "
           "large)" if expandable else "fixed segments (2 MiB small, 20 MiB under 10 MiB, else rounded to 2 MiB)")
    return ("reserved bytes modelled from the caching allocator's rules (hf_accum/probing/reserved.py: 512-byte "
            f"blocks, best fit, {how}, cache emptied before each step as the probe does); the plan fits by them")
