"""The probe's seed where the model is sharded in place by FSDP2 (at load time: `from_pretrained(...,
distributed_config=...)`): each rank holds a shard of the weights, gradients and optimizer state, so the one-process
estimate, which counts them whole, would start the search far too low. The sharded estimate (`paper_sharded.FakeSteps`
for the micro-batch's activations, `sharding.rank_peak` for the rank's shards, gathered layer and buffers) gives the
rank's peak at each size; its largest fit under the budget seeds the search, as the one-process estimate does
(`seed.py`). Every rank computes the same figure from the same config, so every rank starts at the same size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .fits_sharded import fit_on_rank
from .paper_sharded import FakeSteps
from .sharding import parse_sharding


def sharded_record(build: Callable[[], torch.nn.Module], *, shards: int, seq_len: int, budget_bytes: int, cap: int,
                   device: str, bf16: bool, seconds: Callable[[], float]) -> dict[str, Any]:
    """What `seed.estimate_record` keeps, for FSDP2 over ``shards`` ranks: the largest micro-batch up to ``cap``
    whose predicted rank peak fits ``budget_bytes`` (0: not even 1), and the peak at every size stepped."""
    sharding = parse_sharding("fsdp2")
    with FakeSteps(build, seq_lens=[seq_len], device=device, bf16=bf16) as steps:
        fit, peak = fit_on_rank(steps.counts, sharding, shards, lambda m: steps.activations(seq_len, None, m),
                                steps.optimizer, budget_bytes, cap)
        peaks = {m: peak(m) for m in sorted(steps.measured[seq_len, None])}
    return {"largest_fit": fit, "device": device, "seconds": round(seconds(), 3),
            "peaks": {str(m): v for m, v in peaks.items()}, "fitted": None,
            "sharded": f"{sharding.label} over {shards} ranks"}
