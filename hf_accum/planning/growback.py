"""When a plan lowered by an out-of-memory error returns to the probed plan: pure state, no device.

Every auto-batch tool only shrinks: one transient OOM (another process's spike, a long batch) costs a run its probed
plan for good. Here the lowered plan holds for ``after`` clean optimizer steps, then the probed plan is tried again.
If an OOM comes back, the wait doubles, so a recurring OOM costs a handful of re-run windows over a run, not one per
``after`` steps. Every step stays exact whichever plan runs it (any cut of a window is exact); only its speed changes.

    grow = GrowBack(after=16)
    grow.oom()                      # a window was re-run under a lowered plan
    if grow.clean_step():           # an optimizer step ended with no OOM: True when it is time to grow back
        ...                         # the planner restores the plan before the OOM (Planner.step_ended)

Ranks agree on every OOM (protocol.py), so every rank counts the same steps and grows back at the same one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GrowBack:
    after: int = 16  # clean optimizer steps on a lowered plan before the probed plan is tried again; 0: never
    ooms: int = 0  # out-of-memory errors seen in this run
    clean: int = 0  # clean optimizer steps since the last one
    lowered: bool = False  # a lowered plan is in force

    def __post_init__(self) -> None:
        if self.after < 0:
            raise ValueError(f"grow_back_steps={self.after}: set 0 (never grow back) or a number of optimizer steps")

    @property
    def wait(self) -> int:
        """Clean steps the current lowered plan must run: ``after``, doubled for each OOM after the first."""
        return self.after * 2 ** max(0, self.ooms - 1)

    def oom(self) -> None:
        self.ooms += 1
        self.clean = 0
        self.lowered = True

    def clean_step(self) -> bool:
        """One optimizer step ended without an OOM; True when the probed plan should be restored now."""
        if not self.lowered or self.after == 0:
            return False
        self.clean += 1
        if self.clean < self.wait:
            return False
        self.lowered, self.clean = False, 0
        return True
