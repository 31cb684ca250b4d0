"""The levers, one module each, registered here in one line each (`base.register_lever`; docs/development.md, "Adding a lever").

`base` holds the protocol and the registry; the probe, the plan, the planner and the figures iterate the registered
levers and name none of them. `kernels/` holds the LM-head loss kernels (the loss kernel is a lever too:
`kernels/lever.py`); `activation_offload.py` is the offload lever's mechanics. Imports the window engine (the loss's
label rule), config and compat; the probe, the planner, the arguments and the trainer import it.
"""

from __future__ import annotations

from . import offload, selective
from .base import (
    Levels,
    Lever,
    apply_requested,
    check_requests,
    get_lever,
    module_lever,
    parse_pins,
    pinned_records,
    register_lever,
    registered,
    searched,
)
from .checkpointing import CheckpointingLever
from .kernels import lever as loss_kernel

register_lever(CheckpointingLever())
register_lever(module_lever(selective))
register_lever(module_lever(offload))
register_lever(module_lever(loss_kernel))

__all__ = ["Lever", "Levels", "apply_requested", "check_requests", "get_lever", "module_lever", "parse_pins", "pinned_records",
           "register_lever", "registered", "searched"]
