"""Checkpoints on every node (`save_on_each_node=True`, for nodes with no shared filesystem).

transformers 5's `PreTrainedModel.should_save_on_this_rank` (`distributed/mixin.py`) writes a model's files on global
rank 0 only whenever a process group is up, whatever ``is_main_process`` the Trainer passed: with
`save_on_each_node=True` (each node's local rank 0 writes) every node but the first then holds checkpoints with no
weights and no config, and its resume fails ("Can't find a valid checkpoint"). `each_node` lets the Trainer's choice
stand while it saves a model that is not sharded across ranks (one sharded at load time still writes on rank 0 only,
as transformers has it). Pinned by tests/compat/test_compat.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def each_node(model, save_on_each_node: bool) -> Iterator[None]:
    """While it is open, ``model`` writes where the Trainer says it should (``is_main_process``)."""
    own = getattr(model, "config", None) is not None and getattr(model.config, "distributed_config", None) is None
    if not (save_on_each_node and own and hasattr(model, "should_save_on_this_rank")):
        yield
        return
    # this instance only (a PeftModel writes its adapter where is_main_process says already; set on it, harmless)
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        yield
    finally:
        del model.should_save_on_this_rank
