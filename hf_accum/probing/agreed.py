"""Every rank the same trials, where the probe's steps run collectives (a live DeepSpeed engine: `engine.py`; a model
sharded in place by FSDP2: `probe.probe_model`'s ``collective``): a forward that all-gathers waits for every rank, so
no rank may run a size the others skip, or stop its search before them. Each measurement is therefore the largest
over the ranks (one exchange per trial) before the search reads it, and the budget and the limit are the smallest,
so that every rank's search takes the same path; an out-of-memory error stops every rank, saying what to set.

Without this, each rank searched on its own figures and the ranks agreed on the smallest largest fit at the end
(`loop.agree_max_micro_batch`): right where a step runs no collective (DDP's probe steps the unwrapped model), a hang
under FSDP2 wherever two ranks' peaks fell either side of the search's next prediction (seen in
tests/integrations/test_fsdp2.py: rank 0 done after micro-batch 3, rank 1 all-gathering for micro-batch 4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..window.oom import guarded
from ..window.protocol import Collective, StopTraining
from .meters import Measurement, Meter


class AgreedMeter(Meter):
    """``inner``'s measurements, the largest over the ranks, so that every rank's search takes the same path. An
    out-of-memory error stops every rank (announced in the store for the ranks left waiting). ``limit_bytes``: the
    most a step may be predicted to need before it is refused unrun, the same on every rank (default: this rank's)."""

    def __init__(self, inner: Meter, collective: Collective, engine: str, names: str, fit_one: str | None = None,
                 limit_bytes: int | None = None):
        self.inner, self.collective, self.engine, self.names = inner, collective, engine, names
        self.fit_one = fit_one  # what to do when micro-batch 1 runs out of memory, where known better than the default
        self.limit_bytes = limit_bytes
        self.name = inner.name
        self.catches_oom = False  # no rank may skip a size the others run: sizes over the limit are never tried

    def measure(self, fn: Callable[[], Any], *, micro_batch_size: int | None = None) -> Measurement:
        m = self._run(lambda: self.inner.measure(fn, micro_batch_size=micro_batch_size), micro_batch_size)
        reserved = -1 if m.reserved_bytes is None else m.reserved_bytes
        peak, reserved, baseline, rounding, micros = self.collective.max_of(
            (m.peak_bytes, reserved, m.baseline_bytes, m.rounding_bytes, round(m.seconds * 1e6)))
        return Measurement(peak, None if reserved < 0 else reserved, micros / 1e6, baseline, rounding)

    def time(self, fn: Callable[[], Any], *, micro_batch_size: int | None = None) -> float:
        return self._run(lambda: self.inner.time(fn, micro_batch_size=micro_batch_size), micro_batch_size)

    def _run(self, measure, micro: int | None):
        value, oom = guarded(measure)
        if not oom:
            return value
        fix = (f"lower {self.names} or set probe_max_micro_batch below {micro}" if micro and micro > 1 else
               self.fit_one or "to fit micro-batch 1, enable gradient_checkpointing, train LoRA adapters or offload to "
               "CPU in the DeepSpeed config")
        reason = (f"out of memory while the probe ran micro-batch {micro} through {self.engine}, where no rank can "
                  f"skip a size the others run; {fix}")
        self.collective.announce_stop(reason)
        raise StopTraining(reason)

    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes()

    def unavailable_bytes(self) -> int:
        if self.limit_bytes is None:
            return self.inner.unavailable_bytes()
        return self.inner.capacity_bytes() - self.limit_bytes  # capacity - unavailable: the agreed limit

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()


def smallest(collective: Collective, *values: int) -> tuple[int, ...]:
    """Each value's minimum over the ranks (one exchange)."""
    return tuple(-v for v in collective.max_of(tuple(-int(v) for v in values)))


SHARDED = "the model sharded over the ranks (FSDP2)"
SHARDED_FIT_ONE = ("to fit micro-batch 1, enable gradient_checkpointing, train LoRA adapters or shard over more "
                   "ranks")


def in_lockstep(meter: Meter, collective: Collective, budget_bytes: int, names: str) -> tuple[AgreedMeter, int]:
    """``meter`` agreed over ``collective``'s ranks for a model sharded in place, and the budget: the smallest over
    the ranks, as the limit (one exchange for both)."""
    budget, limit = smallest(collective, budget_bytes, meter.capacity_bytes() - meter.unavailable_bytes())
    return AgreedMeter(meter, collective, SHARDED, names, SHARDED_FIT_ONE, limit_bytes=limit), budget
