"""Reading a checkpoint's files without running them: its saved TrainingArguments (unpickled without importing
or executing anything) and which optimizer state it holds. Pinned by tests/trainer/test_checkpoints.py and test_compat.py.
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


# What a checkpoint's loaders read: safetensors files (weights, adapters), torch.save archives (optimizer,
# scheduler, RNG state, .bin weights, DeepSpeed's shards) and JSON (trainer state, configs).
_TORCH_ARCHIVES = (".pt", ".pth", ".bin")


def unreadable_file(checkpoint: str, skip: tuple[str, ...] = ()) -> str | None:
    """Why a file of ``checkpoint`` would not load (``"NAME: why"``), or None. Cheap checks only, no tensor is read:
    a safetensors file must be as long as its header says (its loader's own check), a torch.save archive's zip
    directory must read and every member fit in the file (a truncated archive loses its directory, which sits at the
    end), a JSON file must parse. ``skip``: file names whose reading the caller reports itself."""
    import os

    for root, _, files in os.walk(checkpoint):
        for name in sorted(files):
            if name in skip:
                continue
            path = os.path.join(root, name)
            if name.endswith(".safetensors"):
                why = _safetensors_problem(path)
            elif name.endswith(_TORCH_ARCHIVES):
                why = _torch_archive_problem(path)
            elif name.endswith(".json"):
                why = _json_problem(path)
            else:
                continue
            if why:
                return f"{os.path.relpath(path, checkpoint)}: {why}"
    return None


def _safetensors_problem(path: str) -> str | None:
    import json
    import os
    import struct

    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"a safetensors file of {size} bytes, shorter than its 8-byte header length (truncated)"
            (length,) = struct.unpack("<Q", head)
            if 8 + length > size:
                return f"truncated: its header needs {8 + length} bytes, the file has {size}"
            header = json.loads(f.read(length))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        return f"its safetensors header is unreadable ({type(exc).__name__}: {exc})"
    if 8 + length + end != size:
        return f"truncated or damaged: its header describes {8 + length + end} bytes, the file has {size}"
    return None


def _torch_archive_problem(path: str) -> str | None:
    import os
    import zipfile

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(2)
    if size == 0:
        return "empty (0 bytes)"
    if magic != b"PK":  # torch.save's legacy (pre-1.6, non-zip) format, or not ours to judge
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (OSError, zipfile.BadZipFile, ValueError) as exc:
        return f"not a readable torch archive, probably truncated ({size} bytes; {exc})"
    if any(m.header_offset + m.compress_size > size for m in members):
        return f"truncated: its zip directory lists more data than the file's {size} bytes"
    return None


def _json_problem(path: str) -> str | None:
    import json

    try:
        with open(path) as f:
            json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"unreadable JSON ({type(exc).__name__}: {exc})"
    return None
