"""Reading a checkpoint's files without running them: its saved TrainingArguments (unpickled without importing
or executing anything) and which optimizer state it holds. Pinned by tests/test_checkpoints.py and test_compat.py.
"""

from __future__ import annotations


class _Opaque:
    """Stands for every class in a checkpoint's pickled arguments: records state, runs no code."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state = state[0]
        if isinstance(state, dict):
            self.__dict__.update(state)


def _unpickle_opaque(path: str) -> dict | None:
    """The attributes of the object in a `torch.save` zip (`<archive>/data.pkl`), read without importing or
    calling anything from it: every global becomes `_Opaque`, so a checkpoint's file can be inspected safely."""
    import io
    import pickle
    import zipfile

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            return _Opaque

        def persistent_load(self, pid):
            return None

    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/data.pkl")), None)
            if name is None:
                return None
            data = archive.read(name)
        obj = Unpickler(io.BytesIO(data)).load()
    except Exception:  # an unreadable file is "unknown", decided by the caller
        return None
    return dict(obj.__dict__) if isinstance(obj, _Opaque) else None


def saved_training_args(checkpoint: str) -> dict | None:
    """The fields of the `TrainingArguments` a checkpoint was written with (transformers saves them as
    `training_args.bin` in `save_model`, before `trainer_state.json`); None when absent or unreadable."""
    import os

    from transformers.trainer import TRAINING_ARGS_NAME

    path = os.path.join(checkpoint, TRAINING_ARGS_NAME)
    return _unpickle_opaque(path) if os.path.isfile(path) else None


def optimizer_state_kinds(checkpoint: str) -> frozenset[str]:
    """Which optimizer and scheduler state ``checkpoint`` holds, named by the loader that finds it:

    - ``"trainer"``: what `Trainer._load_optimizer_and_scheduler` looks for without DeepSpeed: an optimizer file
      (`OPTIMIZER_NAME`, `OPTIMIZER_NAME_BIN` (accelerate's FSDP), a folder named like it (sharded FSDP), SageMaker's
      `OPTIMIZER_NAME_*`, XLA FSDP's `rank*-of-N-OPTIMIZER_NAME`) *and* `SCHEDULER_NAME`;
    - ``"deepspeed"``: a `global_step*` entry, what `deepspeed_load_checkpoint` looks for (the engine keeps both).

    Empty for a checkpoint written with `save_only_model=True`. transformers does not say so: without the files
    it goes on with a fresh optimizer and schedule (5.17 to 5.23), DeepSpeed aside (it raises)."""
    import glob
    import os

    from transformers.trainer import OPTIMIZER_NAME, OPTIMIZER_NAME_BIN, SCHEDULER_NAME

    if not os.path.isdir(checkpoint):
        return frozenset()
    names = os.listdir(checkpoint)
    folder = glob.escape(checkpoint)
    optimizer = (
        os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME))
        or os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME_BIN))
        or any(OPTIMIZER_NAME_BIN.split(".")[0] in n for n in names if os.path.isdir(os.path.join(checkpoint, n)))
        or bool(glob.glob(os.path.join(folder, OPTIMIZER_NAME) + "_*"))
        or bool(glob.glob(os.path.join(folder, f"rank*-of-*-{OPTIMIZER_NAME}")))
    )
    kinds = set()
    if optimizer and os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
        kinds.add("trainer")
    if any(n.startswith("global_step") for n in names):
        kinds.add("deepspeed")
    return frozenset(kinds)
