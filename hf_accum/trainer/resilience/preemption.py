"""Preemption: SIGTERM (SLURM, spot machines, `kill`, torchrun forwarding its own SIGTERM) or a first Ctrl-C asks
training to stop after the optimizer step in progress, with a checkpoint; a second Ctrl-C stops at once.

The handler only records the request (nothing heavy runs inside a signal handler). The window protocol's `done`
exchange (protocol.py) makes every rank stop after the same step; the Trainer then saves a checkpoint (with
its plan) and `train()` raises `Preempted`, a `SystemExit` with code `EXIT_PREEMPTED`, after logging how to
resume.

Time: torchrun forwards SIGTERM to its workers and kills them `TORCHRUN_GRACE_S` seconds later
(`shutdown_timeout` in torch.distributed.elastic.agent.server.api); SLURM's default between SIGTERM and SIGKILL
is `KillWait`, 30 s. The step in progress plus the checkpoint must fit in that; the stop message says how long
it took, and says so loudly when it did not fit.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time

from .output_guard import OutputGuard

logger = logging.getLogger(__name__)

EXIT_PREEMPTED = 143  # 128 + SIGTERM, what a process killed by SIGTERM reports: schedulers requeue on it
TORCHRUN_GRACE_S = 30


class Preempted(SystemExit):  # noqa: N818 - exits the process unless caught, like SystemExit
    """Training stopped on a signal after saving a checkpoint."""

    def __init__(self, message: str):
        super().__init__(EXIT_PREEMPTED)
        self.message = message

    def __str__(self) -> str:
        return self.message


class StoppedAtOnce(KeyboardInterrupt):
    """A second Ctrl-C: training stopped at once, without finishing the step or saving."""

    def __str__(self) -> str:
        return ("hf_accum: a second Ctrl-C stopped the run at once: the step in progress was not finished and no "
                "checkpoint of it was saved (one being written may be incomplete: resume_from_checkpoint=True "
                "passes over it and resumes the newest checkpoint that loads).")


class StopRequest:
    """Records the first SIGTERM / SIGINT while installed; restores the previous handlers on exit."""

    def __init__(self):
        self.signal_name: str | None = None
        self.at: float | None = None
        self._output = OutputGuard()

    def __bool__(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame):
        if self.signal_name is None:
            self.signal_name, self.at = signal.Signals(signum).name, time.monotonic()
            self._output.start()  # before the line below: a Ctrl-C may have taken `| tee` down with us
            logger.warning("hf_accum: %s received: finishing the optimizer step in progress, then saving a "
                           "checkpoint and stopping (a second Ctrl-C stops at once).", self.signal_name)
        elif signum == signal.SIGINT:  # stops now, whatever runs (the step, the save): as the line above says
            raise StoppedAtOnce

    @contextlib.contextmanager
    def installed(self, enabled: bool = True):
        if not enabled or threading.current_thread() is not threading.main_thread():
            yield self  # signals can only be handled on the main thread
            return
        saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        for s in saved:
            signal.signal(s, self._handle)
        try:
            yield self
        finally:
            for s, handler in saved.items():
                signal.signal(s, handler)
            self._output.stop()

    @property
    def dead_streams(self) -> set[str]:
        """stdout / stderr whose reader died while stopping (`OutputGuard.dead`)."""
        return self._output.dead

    def seconds_since(self) -> float:
        return time.monotonic() - self.at if self.at is not None else 0.0
