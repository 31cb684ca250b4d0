"""DDP (several processes, one replica each): gradients are averaged in the window's last backward only
(accelerate's `no_sync` around the others); every forward is local, so a rank that ran out of memory may skip its
remaining forwards and the window is re-run together (`protocol.py`'s ``rerun``)."""

from __future__ import annotations

from .base import Engine


class Ddp(Engine):
    """Every behaviour is the plain one: accelerate's `no_sync` is DDP's, and `window_policy` reruns."""


__all__ = ["Ddp"]
