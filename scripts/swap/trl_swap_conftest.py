"""pytest plugin for `trl_swap_suite.py`: runs TRL's own SFT / DPO / Reward / GRPO trainer tests offline, plain or with
hf_accum's classes swapped in, optionally with gradient_accumulation_steps forced. Environment:

- HF_ACCUM_TRL_SWAP=1: `trl.SFTTrainer` / `SFTConfig` / `DPOTrainer` / `DPOConfig` / `RewardTrainer` / (and GRPO's)
  `RewardConfig` (in `trl` and `trl.trainer`, where the tests import them from) become `AccumSFTTrainer`, ... of
  `hf_accum.trl`. TRL's own modules keep their classes, so TRL's internals behave as TRL wrote them.
- HF_ACCUM_TRL_GA=N: every TRL config (`_BaseConfig`, so ours too) gets gradient_accumulation_steps=N, whatever the
  test set.
- HF_ACCUM_TRL_TARGET=1 (with the swap): every one of our configs that sets no `target_batch_size` gets the one its
  batch settings imply (per_device_train_batch_size x gradient_accumulation_steps x world), as a new user would.
- HF_ACCUM_TRL_RECORD=FILE: one JSON line per trainer built ({"test", "cls", "accum", "ga"}), and one for the swap.

Loaded with `-p trl_swap_conftest` (the suite puts scripts/ on PYTHONPATH), so all this happens before any test module
is collected. Offline: `datasets.load_dataset` is `trl_standins.load_dataset`, and models come from the hub cache the
suite filled with stand-ins (HF_HUB_OFFLINE=1). A test that fails because it loads a hub id with no stand-in is
reported as skipped ("no local stand-in for ..."), in every mode alike.

The tests come from a TRL checkout that need not match the installed TRL exactly: a name they import that the
installed TRL lacks is defined here as a stub that raises, so the file still collects and only the tests using it fail
(in every mode alike).
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import trl_standins

SWAP = os.environ.get("HF_ACCUM_TRL_SWAP", "0") == "1"
FORCE_GA = int(os.environ.get("HF_ACCUM_TRL_GA") or 0)
FORCE_TARGET = SWAP and os.environ.get("HF_ACCUM_TRL_TARGET") == "1"
RECORD = os.environ.get("HF_ACCUM_TRL_RECORD")

import importlib  # noqa: E402

import datasets  # noqa: E402
import transformers  # noqa: E402
import transformers.utils.hub  # noqa: E402
import trl  # noqa: E402
import trl.trainer  # noqa: E402
from trl.trainer.base_config import _BaseConfig  # noqa: E402

import hf_accum.trl as accum_trl  # noqa: E402

_current_test: str | None = None


def _write(entry: dict) -> None:
    if RECORD:
        with open(RECORD, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")


# --- names the tests import that this TRL lacks ----------------------------------------------------------
def _absent(name):
    def stub(*args, **kwargs):
        raise NotImplementedError(f"{name} is not in the installed TRL {trl.__version__} (stub of trl_swap_conftest)")

    return stub


STUBS = {"trl.import_utils": {"is_joblib_available": lambda: False},
         "trl.trainer.sft_trainer": {n: _absent(n) for n in ("_chunked_cross_entropy_loss", "_patch_chunked_ce_lm_head",
                                                           "dft_loss")}}
STUBBED = []
for _module_name, _names in STUBS.items():
    _module = importlib.import_module(_module_name)  # trl's lazy modules hide submodules from attribute access
    for _name, _value in _names.items():
        if not hasattr(_module, _name):
            setattr(_module, _name, _value)
            STUBBED.append(f"{_module.__name__}.{_name}")

# --- offline data and models ------------------------------------------------------------------------------
datasets.load_dataset = trl_standins.load_dataset


def _standins_only(download):
    """transformers' hub download, refusing a hub id with no stand-in by name (offline, the hub's own error does
    not name the repository, so the skip below could not say which one was missing)."""

    @functools.wraps(download)
    def wrapper(repo_id, *args, **kwargs):
        if trl_standins.missing_ids(str(repo_id)) == [repo_id]:
            # transformers re-raises a ValueError from the download as OSError with its text
            raise ValueError(f"no local stand-in for {repo_id}")
        return download(repo_id, *args, **kwargs)

    return wrapper


for _name in ("hf_hub_download", "snapshot_download"):
    setattr(transformers.utils.hub, _name, _standins_only(getattr(transformers.utils.hub, _name)))


# --- the swap ---------------------------------------------------------------------------------------------
SWAPS = {"SFTTrainer": accum_trl.AccumSFTTrainer, "SFTConfig": accum_trl.AccumSFTConfig,
         "DPOTrainer": accum_trl.AccumDPOTrainer, "DPOConfig": accum_trl.AccumDPOConfig,
         "RewardTrainer": accum_trl.AccumRewardTrainer, "RewardConfig": accum_trl.AccumRewardConfig,
         "GRPOTrainer": accum_trl.AccumGRPOTrainer, "GRPOConfig": accum_trl.AccumGRPOConfig}
if SWAP:
    for _name, _cls in SWAPS.items():
        for _namespace in (trl, trl.trainer):
            setattr(_namespace, _name, _cls)
        if getattr(trl, _name) is not _cls:
            raise RuntimeError(f"trl_swap_conftest: trl.{_name} could not be replaced by {_cls.__name__}")
    _write({"kind": "swap", "replaced": sorted(SWAPS), "by": sorted(c.__name__ for c in SWAPS.values()),
            "stubbed": STUBBED})


def _recording_init(init):
    @functools.wraps(init)  # keeps the signature: AccumulationMixin binds its arguments against it
    def __init__(self, *args, **kwargs):
        targs = kwargs.get("args")
        _write({"kind": "trainer", "test": _current_test, "cls": f"{type(self).__module__}.{type(self).__qualname__}",
                "accum": isinstance(self, accum_trl.AccumulationMixin),
                "ga": getattr(targs, "gradient_accumulation_steps", None),
                "target": getattr(targs, "target_batch_size", None)})
        return init(self, *args, **kwargs)

    return __init__


transformers.Trainer.__init__ = _recording_init(transformers.Trainer.__init__)

if FORCE_GA or FORCE_TARGET:
    _post_init = _BaseConfig.__post_init__

    @functools.wraps(_post_init)
    def _forced_post_init(self):
        if FORCE_GA:
            self.gradient_accumulation_steps = FORCE_GA
        if FORCE_TARGET and isinstance(self, accum_trl.AccumTrainingArguments) and self.target_batch_size is None:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            self.target_batch_size = self.per_device_train_batch_size * self.gradient_accumulation_steps * world
        _post_init(self)

    _BaseConfig.__post_init__ = _forced_post_init


def pytest_configure(config):
    for marker in ("slow", "low_priority"):
        config.addinivalue_line("markers", f"{marker}: TRL's marker")


def pytest_runtest_logstart(nodeid, location):
    global _current_test
    _current_test = nodeid


def _chain_text(exc) -> str:
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure that names a hub id with no stand-in (model or dataset) is reported as skipped, with that id."""
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None or not report.failed or call.excinfo.errisinstance(pytest.skip.Exception):
        return
    missing = trl_standins.missing_ids(_chain_text(call.excinfo.value))
    if missing:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: no local stand-in for {', '.join(missing)}")
