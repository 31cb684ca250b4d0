"""The LM-head loss kernels behind one seam (`base.token_loss`), registered here in one line each; a well-kept
library's kernel first, ours (`chunked`, runs everywhere) last. The probe times those that run and the plan takes
the fastest that fits (`base.choose`); the estimate reads their memory models (`base.Memory`)."""

from __future__ import annotations

from . import chunked, cut_ce, liger, torch_lce
from .base import Memory, choose, default, get, refuse_settings, register, registered, runnable, token_loss, unavailable

register(cut_ce)
register(liger)
register(torch_lce)
register(chunked)

__all__ = ["Memory", "choose", "default", "get", "refuse_settings", "register", "registered", "runnable",
           "token_loss", "unavailable"]
