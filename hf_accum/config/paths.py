"""Whether a directory can really be written: `os.access` says yes to root everywhere, even in /proc, where the
first `makedirs` fails. Imports nothing heavy (the recipe checks run before torch is loaded)."""

from __future__ import annotations

import os
import tempfile

PLAN_FILE = "hf_accum_plan.json"  # the plan file in output_dir and in each checkpoint (planning/store.py writes it)


def nearest_existing(path: str) -> str:
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return parent


def can_create_in(folder: str) -> bool:
    """Create and remove one empty directory in ``folder``: leaves it as it was."""
    if not os.path.isdir(folder):
        return False
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".hf_accum_write_check_", dir=folder))
    except OSError:
        return False
    return True
