"""pytest plugin for `trainer_swap_suite.py`: runs transformers' own Trainer tests with `AccumTrainer` in place
of `Trainer` (HF_ACCUM_SWAP=1), or plain (HF_ACCUM_SWAP=0); in both modes it records every trainer built. With
HF_ACCUM_SWAP_TARGET=1 (and the swap) `TrainingArguments` is also `AccumTrainingArguments` with every object given the
target its batch settings imply.

Loaded with `-p swap_conftest`, so it is imported while pytest configures, before any test module is collected:
the tests' `from transformers import Trainer` (and `transformers.trainer.Trainer`) then find `AccumTrainer`,
and so do the classes they derive from it.

Records (JSON lines, appended to $HF_ACCUM_SWAP_RECORD as they happen, so a killed run keeps them):
- {"kind": "trainer", "test": nodeid, "cls": "module.Class", "accum": bool}: one per trainer __init__;
- {"kind": "module", "module": name, "trainer": "module.Class" | null, "accum": bool}: the `Trainer` each
  collected test module (and the helper modules they import) holds once collected;
- {"kind": "swap", ...}: what was replaced, once.
"""

from __future__ import annotations

import functools
import json
import os
import sys

SWAP = os.environ.get("HF_ACCUM_SWAP", "1") == "1"
TARGET = SWAP and os.environ.get("HF_ACCUM_SWAP_TARGET", "0") == "1"  # swapped-target mode
RECORD = os.environ.get("HF_ACCUM_SWAP_RECORD")

# Everything of hf_accum (and transformers' own subclasses) is imported before the swap, so the names they bind
# at import time stay transformers' Trainer: AccumTrainer must derive from the real class, and so must
# AccumSeq2SeqTrainer (tests/trainer/test_trainer_seq2seq.py's `Seq2SeqTrainer` is swapped for it).
import transformers  # noqa: E402
import transformers.trainer  # noqa: E402
import transformers.trainer_seq2seq  # noqa: E402, F401

from hf_accum.args import AccumTrainingArguments  # noqa: E402
from hf_accum.compat import trainer_internals  # noqa: E402, F401
from hf_accum.planning import tuning  # noqa: E402, F401
from hf_accum.trainer import AccumTrainer, AccumulationMixin  # noqa: E402
from hf_accum.trainer.seq2seq import AccumSeq2SeqTrainer, AccumSeq2SeqTrainingArguments  # noqa: E402

ORIGINAL = transformers.trainer.Trainer
_current_test: str | None = None


def _write(entry: dict) -> None:
    if RECORD:
        with open(RECORD, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")


def _qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _recording_init(init):
    @functools.wraps(init)  # keeps the signature: AccumulationMixin binds its arguments against it
    def __init__(self, *args, **kwargs):
        # Every trainer, whatever its class, runs Trainer.__init__ exactly once.
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        _write({"kind": "trainer", "test": _current_test, "cls": _qualname(type(self)),
                "accum": isinstance(self, AccumulationMixin),
                "target": getattr(training_args, "target_batch_size", None)})
        return init(self, *args, **kwargs)

    return __init__


ORIGINAL.__init__ = _recording_init(ORIGINAL.__init__)

if SWAP:
    transformers.Trainer = AccumTrainer
    transformers.trainer.Trainer = AccumTrainer
    if not (transformers.Trainer is AccumTrainer and sys.modules["transformers"].Trainer is AccumTrainer):
        raise RuntimeError("swap_conftest: transformers.Trainer could not be replaced by AccumTrainer")
    _write({"kind": "swap", "replaced": ["transformers.Trainer", "transformers.trainer.Trainer"],
            "by": _qualname(AccumTrainer), "original": _qualname(ORIGINAL)})
    transformers.Seq2SeqTrainer = AccumSeq2SeqTrainer
    _write({"kind": "swap", "replaced": ["transformers.Seq2SeqTrainer"], "by": _qualname(AccumSeq2SeqTrainer),
            "original": "transformers.trainer_seq2seq.Seq2SeqTrainer"})



class TargetedTrainingArguments(AccumTrainingArguments):
    """What a new user writes: `AccumTrainingArguments` with the target its batch settings already imply
    (per_device_train_batch_size x gradient_accumulation_steps x world), unless the test set one."""

    def __post_init__(self):
        if self.target_batch_size is None:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            self.target_batch_size = self.per_device_train_batch_size * self.gradient_accumulation_steps * world
        super().__post_init__()


class TargetedSeq2SeqTrainingArguments(AccumSeq2SeqTrainingArguments):
    """`TargetedTrainingArguments` for `Seq2SeqTrainingArguments`."""

    def __post_init__(self):
        if self.target_batch_size is None:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            self.target_batch_size = self.per_device_train_batch_size * self.gradient_accumulation_steps * world
        super().__post_init__()


if TARGET:  # the tests' `from transformers import TrainingArguments` (and their subclasses of it) find it
    transformers.TrainingArguments = TargetedTrainingArguments
    transformers.Seq2SeqTrainingArguments = TargetedSeq2SeqTrainingArguments
    _write({"kind": "swap", "replaced": ["transformers.TrainingArguments"], "by": _qualname(TargetedTrainingArguments),
            "original": "transformers.training_args.TrainingArguments"})
    _write({"kind": "swap", "replaced": ["transformers.Seq2SeqTrainingArguments"],
            "by": _qualname(TargetedSeq2SeqTrainingArguments),
            "original": "transformers.training_args_seq2seq.Seq2SeqTrainingArguments"})


def pytest_configure(config):
    config.addinivalue_line("markers", "torch_compile_test: transformers' marker")
    config.addinivalue_line("markers", "slow: transformers' marker")


def pytest_collection_modifyitems(session, config, items):
    seen = set()
    for item in items:
        module = getattr(item, "module", None)
        if module is None or module.__name__ in seen:
            continue
        seen.add(module.__name__)
        # The test module and any sibling module it imported (e.g. tests.trainer.trainer_test_utils).
        package = module.__name__.rpartition(".")[0]
        for name, mod in list(sys.modules.items()):
            if mod is None or (name in seen and name != module.__name__):
                continue
            if name != module.__name__ and not (package and name.startswith(package + ".")):
                continue
            seen.add(name)
            cls = getattr(mod, "Trainer", None)
            _write({"kind": "module", "module": name, "trainer": _qualname(cls) if isinstance(cls, type) else None,
                    "accum": isinstance(cls, type) and issubclass(cls, AccumulationMixin)})


def pytest_runtest_logstart(nodeid, location):
    global _current_test
    _current_test = nodeid
