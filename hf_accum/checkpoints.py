"""Which checkpoint a resume continues from. (Minimal; the "Nothing silent, part 1" issue owns this module.)"""

from __future__ import annotations

import os
import re

from .plan_store import PLAN_FILE

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def newest_complete_checkpoint(output_dir: str) -> str | None:
    """The newest `checkpoint-N` folder of ``output_dir`` that is complete (holds trainer_state.json and the plan
    file); None when there is none. A half-written newest checkpoint is passed over for the one before it."""
    if not os.path.isdir(output_dir):
        return None
    steps = sorted(
        (int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))
    )
    for _, name in reversed(steps):
        folder = os.path.join(output_dir, name)
        if all(os.path.isfile(os.path.join(folder, f)) for f in ("trainer_state.json", PLAN_FILE)):
            return folder
    return None
