"""A stopping run must not die of its own output. Ctrl-C reaches the whole process group, so `hf-accum train ... |
tee log` loses its reader (tee) at the same moment: the next print, log line or progress-bar update raises
BrokenPipeError, before the checkpoint is saved. Once a stop is requested, stdout and stderr (where they are pipes)
are routed through a pipe of this process; a thread copies what arrives to the original pipe while it has a reader
and drops it after. When training ends, a dead pipe is replaced by /dev/null, so that the final messages and
Python's own flush at exit fail silently instead of with a traceback."""

from __future__ import annotations

import os
import stat
import sys
import threading

_STREAMS = ((1, "stdout"), (2, "stderr"))


class OutputGuard:
    def __init__(self):
        self._routes: list[tuple] = []
        self.dead: set[str] = set()  # the streams whose reader was gone when the guard stopped

    def start(self) -> None:
        """Route every stream that is a pipe through this process (cheap: safe in a signal handler)."""
        if self._routes:
            return
        for fd, name in _STREAMS:
            try:
                if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                    continue
                _flush(name)
                original = os.dup(fd)
                read, write = os.pipe()
                os.dup2(write, fd)
                os.close(write)
            except OSError:
                continue
            state = {"dead": False}
            thread = threading.Thread(target=_copy, args=(read, original, state), daemon=True)
            thread.start()
            self._routes.append((fd, name, original, read, thread, state))

    def stop(self) -> None:
        """Put each stream back (or /dev/null where its reader is gone), after copying what is left."""
        for fd, name, original, _read, thread, state in self._routes:
            _flush(name)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)  # closes our pipe's last write end: the copier reads to its end
            os.close(devnull)
            thread.join(timeout=5)
            if not state["dead"]:
                os.dup2(original, fd)
            else:
                self.dead.add(name)
            os.close(original)
        self._routes = []


def tell(message: str, dead: set[str] | frozenset[str] = frozenset()) -> None:
    """Put ``message`` where a person sees it: stderr, or the terminal itself (/dev/tty) where stderr's reader is
    ``dead`` (a Ctrl-C took `2>&1 | tee` down with the run)."""
    if "stderr" not in dead:
        print(message, file=sys.stderr, flush=True)
        return
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(message + "\n")
    except OSError:  # no terminal: the file in output_dir holds it (stopping.raise_if_stopped)
        pass


def _flush(name: str) -> None:
    try:
        getattr(sys, name).flush()
    except (OSError, ValueError, AttributeError):
        pass


def _copy(read: int, original: int, state: dict) -> None:
    with os.fdopen(read, "rb", buffering=0) as source:
        while chunk := source.read(65536):
            if state["dead"]:
                continue
            try:
                os.write(original, chunk)
            except BrokenPipeError:
                state["dead"] = True
