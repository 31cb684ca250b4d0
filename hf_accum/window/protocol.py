"""How the data-parallel ranks of one accumulation window agree, as explicit state with named transitions.

**Invariant: in each window every rank makes the same collective calls, in the same order.** A rank that made
one more or one fewer would hang the others (or pair its values with another call's). Each transition below
says which collective it makes; `tests/window/test_protocol.py` counts them on every path with a fake collective.

Phases of one window (``begin`` .. ``finish``), under the ``rerun`` policy:

    COUNTING --begin: sum(count)--> RUNNING --micro_oom--> SKIPPING
    RUNNING | SKIPPING --before_final: any(oom)--> FINAL                 (no rank ran out of memory so far)
                                              \\-> RESTART                (some rank did: all re-run the window)
    FINAL --after_final_forward: any(oom)--> BACKWARD                    (the final backward may synchronize)
                                        \\-> DRAINING --drained--> RESTART  (complete the DDP iteration, then re-run)
    RESTART --rerun--> RUNNING   (same window, same count: no new sum)
    BACKWARD --done: any(non-finite loss, stop requested)--> IDLE    (skip this optimizer step? stop after it?)

Collectives per window (world > 1): a normal window 4 (sum, any, any, and `done`'s one exchange of two flags); an
OOM in a non-final forward 2 + 2 per re-run + 1; an OOM in the final forward 3 + 2 per re-run + 1; an OOM in the
final backward 3, then every rank stops (`StopTraining`): the other ranks are inside that backward's gradient
all-reduce, so no agreement can follow. The stopping rank leaves its reason in the process group's store (not a
collective); the others' pending collective fails when it exits, and they stop with that reason (`peer_stopped`). `done` is where ranks agree to skip a step whose window loss is not
finite on some rank, and to stop after this step when some rank was asked to (SIGTERM, SIGINT): every rank then
skips, and stops, after the same step. With `micro_batching="tokens"` each window (and each re-run) adds one
`agree_forwards` exchange before its first forward.

Policies, by engine:
- ``rerun`` (one process, or DDP): a rank that ran out of memory skips its remaining non-final forwards (DDP's
  non-final forwards under ``no_sync`` make no collective), and the window is re-run together.
- ``stop`` (engines with collectives inside every forward or backward: FSDP2, DeepSpeed ZeRO, or a trainer
  whose ``compute_loss`` gathers metrics, as TRL's do): skipping a forward would hang the other ranks, so with
  world > 1 an OOM anywhere stops every rank at once, with the plan to restart with. Only the window count is
  exchanged (1 collective per window). With world 1 there is nobody to hang: ``rerun`` applies.
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch

from ..compat import process_group

_COLLECTIVES = "under an engine with collectives in every forward (FSDP, DeepSpeed ZeRO, or a compute_loss that gathers)"


class Phase(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    SKIPPING = "skipping"
    FINAL = "final"
    BACKWARD = "backward"
    DRAINING = "draining"
    RESTART = "restart"


class Policy(enum.Enum):
    RERUN = "rerun"
    STOP = "stop"


class Collective(Protocol):
    """What the protocol needs from the process group; injected so tests can count every call."""

    world: int

    def sum(self, value: torch.Tensor) -> torch.Tensor: ...

    def any(self, flag: bool) -> bool: ...

    def any_of(self, flags: tuple[bool, ...]) -> tuple[bool, ...]: ...

    def max_of(self, values: tuple[int, ...]) -> tuple[int, ...]: ...

    def announce_stop(self, reason: str) -> None: ...

    def peer_stop(self) -> str | None: ...


class Local:
    """One process: nothing to exchange."""

    world = 1

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def any(self, flag: bool) -> bool:
        return flag

    def any_of(self, flags: tuple[bool, ...]) -> tuple[bool, ...]:
        return tuple(flags)

    def max_of(self, values: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(values)

    def announce_stop(self, reason: str) -> None:
        pass

    def peer_stop(self) -> str | None:
        return None


class TorchDistributed:
    """The default process group (DDP, FSDP, DeepSpeed all run one)."""

    def __init__(self, world: int, device):
        self.world, self.device = world, device

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        value = value.to(self.device).clone()
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.SUM)
        return value

    def any(self, flag: bool) -> bool:
        return self.any_of((flag,))[0]

    def any_of(self, flags: tuple[bool, ...]) -> tuple[bool, ...]:
        return tuple(bool(x) for x in self.max_of(tuple(int(f) for f in flags)))

    def max_of(self, values: tuple[int, ...]) -> tuple[int, ...]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return tuple(int(x) for x in t.tolist())

    # A rank that stops while the others are inside a collective cannot tell them through that collective: it
    # leaves the reason in the process group's key-value store (no collective, nothing to pair), and a rank whose
    # collective then fails because its peer left reads it there (`WindowProtocol.peer_stopped`).
    def announce_stop(self, reason: str) -> None:
        store = process_group.default_store()
        if store is not None:
            store.set(_STOP_KEY, reason)

    def peer_stop(self) -> str | None:
        store = process_group.default_store()
        if store is None or not store.check([_STOP_KEY]):
            return None
        return store.get(_STOP_KEY).decode()


_STOP_KEY = "hf_accum/stop"


class StopTraining(RuntimeError):
    """Every rank stops: the window cannot be re-run without risking diverging or hanging ranks."""


class Restart(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Every rank re-runs the current window with a smaller cut (raised only where all ranks raise it)."""


class WindowProtocol:
    """The per-window agreement state machine. Owns no tensors of the model; only flags and the collective."""

    def __init__(self, collective: Collective, policy: Policy):
        self.collective = collective
        self.policy = policy if collective.world > 1 else Policy.RERUN
        self.phase = Phase.IDLE

    @property
    def world(self) -> int:
        return self.collective.world

    def _expect(self, *phases: Phase) -> None:
        if self.phase not in phases:
            raise RuntimeError(f"hf_accum window protocol: {self.phase.value} -> expected {[p.value for p in phases]}")

    # --- transitions ----------------------------------------------------------------------------------------
    def begin(self, local_count: torch.Tensor) -> torch.Tensor:
        """A new window: the count of every rank summed (1 collective)."""
        self.phase = Phase.RUNNING
        return self.collective.sum(local_count) if self.world > 1 else local_count

    def micro_oom(self) -> None:
        """This rank ran out of memory in a non-final forward/backward of the window."""
        self._expect(Phase.RUNNING, Phase.SKIPPING)
        if self.policy is Policy.STOP:
            self._stop(f"out of memory in a micro-batch, {_COLLECTIVES}")
        self.phase = Phase.SKIPPING

    @property
    def skipping(self) -> bool:
        return self.phase is Phase.SKIPPING

    def before_final(self) -> None:
        """Before the window's final forward: all ranks agree whether any ran out of memory (1 collective under
        ``rerun``, none under ``stop``). Raises `Restart` on every rank together."""
        self._expect(Phase.RUNNING, Phase.SKIPPING)
        mine = self.phase is Phase.SKIPPING
        if self.policy is Policy.RERUN and self.world > 1:
            mine = self.collective.any(mine)
        if mine:
            self.phase = Phase.RESTART
            raise Restart()
        self.phase = Phase.FINAL

    def after_final_forward(self, oom: bool) -> bool:
        """Between the final forward and its backward (1 collective under ``rerun``). Returns True when the
        window must be re-run; with world > 1 the caller then completes the DDP iteration (`drained`)."""
        self._expect(Phase.FINAL)
        if self.policy is Policy.STOP and oom:
            self._stop(f"out of memory in the window's final forward, {_COLLECTIVES}")
        restart = self.collective.any(oom) if self.policy is Policy.RERUN and self.world > 1 else oom
        if not restart:
            self.phase = Phase.BACKWARD
            return False
        if self.world == 1:
            self.phase = Phase.RESTART
            raise Restart()
        self.phase = Phase.DRAINING
        return True

    def drained(self) -> None:
        """The draining iteration's backward is done on every rank: re-run together."""
        self._expect(Phase.DRAINING)
        self.phase = Phase.RESTART
        raise Restart()

    def final_backward_oom(self) -> None:
        """Out of memory in the final backward: with world > 1 the others are in its all-reduce: stop."""
        self._expect(Phase.BACKWARD, Phase.FINAL)
        if self.world > 1:
            self._stop("out of memory inside the gradient-synchronizing backward pass")
        self.phase = Phase.RESTART
        raise Restart()

    def done(self, nonfinite: bool, stop_requested: bool) -> tuple[bool, bool]:
        """The window's gradients are complete on every rank: agree (1 collective) whether any rank's window loss
        was not finite (every rank skips the optimizer step) and whether any rank was asked to stop (every rank
        stops after this step). Returns (skip, stop)."""
        self._expect(Phase.BACKWARD, Phase.FINAL, Phase.RUNNING)
        self.phase = Phase.IDLE
        if self.world == 1:
            return nonfinite, stop_requested
        skip, stop = self.collective.any_of((nonfinite, stop_requested))
        return skip, stop

    def agree_forwards(self, counts: tuple[int, ...]) -> tuple[int, ...]:
        """Token-budget windows: forwards per loaded batch, the maximum over ranks (1 collective), so that every
        rank runs the same number (DDP broadcasts buffers in every forward; sharded engines gather parameters)."""
        self._expect(Phase.RUNNING)
        return self.collective.max_of(counts) if self.world > 1 else counts

    def _stop(self, reason: str):
        self.collective.announce_stop(reason)
        raise StopTraining(reason)

    def peer_stopped(self) -> str | None:
        """Why another rank stopped (`StopTraining` there), if one did: a rank whose collective failed asks."""
        return self.collective.peer_stop() if self.world > 1 else None

    def rerun(self) -> None:
        self._expect(Phase.RESTART)
        self.phase = Phase.RUNNING

    def finish(self) -> None:
        self.phase = Phase.IDLE
