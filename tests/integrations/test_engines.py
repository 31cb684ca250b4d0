"""The engine seam (hf_accum/integrations/engines/): which engine runs a trainer, what each says where engines differ, and that
the trainer and the planner reach engine internals only through it."""

from __future__ import annotations

import ast
import contextlib
import pathlib
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from hf_accum.integrations import engines
from hf_accum.integrations.engines.base import Engine
from hf_accum.integrations.engines.ddp import Ddp
from hf_accum.integrations.engines.deepspeed import DeepSpeed
from hf_accum.integrations.engines.fsdp import Fsdp
from hf_accum.window.protocol import Policy

ROOT = pathlib.Path(__file__).resolve().parents[2] / "hf_accum"


class _Accelerator:
    def __init__(self, kind=DistributedType.NO, processes=1, stage=None):
        self.distributed_type, self.num_processes = kind, processes
        self.state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=stage))
        self.synced = []

    @contextlib.contextmanager
    def no_sync(self, model):
        self.synced.append(False)
        yield


class _Trainer:  # weakly referable, as the engine holds its trainer
    def __init__(self, kind=DistributedType.NO, processes=1, stage=None, model=None, fsdp=""):
        self.accelerator = _Accelerator(kind, processes, stage)
        self.model = model if model is not None else torch.nn.Linear(2, 2)
        self.model_wrapped = "wrapped"
        self.args = SimpleNamespace(fsdp=fsdp, deepspeed=None)


@pytest.mark.parametrize("kind, processes, stage, expected, label", [
    (DistributedType.NO, 1, None, Engine, None),
    (DistributedType.MULTI_CPU, 2, None, Ddp, None),
    (DistributedType.MULTI_GPU, 4, None, Ddp, None),
    (DistributedType.FSDP, 2, None, Fsdp, None),
    (DistributedType.DEEPSPEED, 1, 2, DeepSpeed, "DeepSpeed ZeRO-2"),
    (DistributedType.DEEPSPEED, 2, 3, DeepSpeed, "DeepSpeed ZeRO-3"),
])
def test_select(kind, processes, stage, expected, label, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(processes))
    engine = engines.select(_Trainer(kind, processes, stage, fsdp="full_shard" if kind is DistributedType.FSDP else ""))
    assert type(engine) is expected and engine.label == label


def test_a_model_sharded_at_load_runs_on_fsdp_and_cannot_resume(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    model = torch.nn.Linear(2, 2)
    model.is_distributed_loading_by_transformers = True
    engine = engines.select(_Trainer(model=model))
    assert type(engine) is Fsdp and not engine.resumable and not engine.checkpoints_optimizer
    assert engines.select(_Trainer()).resumable
    # its forwards all-gather in the probe too: every rank must run the same trials (probing/agreed.py)
    assert engine.probe_runs_collectives


def test_what_each_engine_says(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    trainers = [_Trainer(), _Trainer(DistributedType.MULTI_CPU, 2), _Trainer(DistributedType.FSDP, 2),
                _Trainer(DistributedType.DEEPSPEED, 2, 3), _Trainer(DistributedType.FSDP, 1),
                _Trainer(DistributedType.DEEPSPEED, 1, 2)]  # kept alive: engines hold them weakly
    plain, ddp, fsdp, ds = Engine(trainers[0]), Ddp(trainers[1]), Fsdp(trainers[2]), DeepSpeed(trainers[3])
    for engine in (plain, ddp):
        assert engine.window_policy(False) is Policy.RERUN and engine.window_policy(True) is Policy.STOP
        assert not engine.steps_in_backward and engine.no_rerun_reason is None and not engine.own_optimizer_files
    assert fsdp.window_policy(False) is Policy.STOP and ds.window_policy(False) is Policy.STOP
    assert ds.steps_in_backward and ds.probes_through_engine and ds.own_optimizer_files
    assert "out of memory under DeepSpeed" in ds.no_rerun_reason
    assert ds.probe_before_train(16).endswith("target_batch_size=16.")
    assert plain.probe_before_train(16) is None and not plain.probes_through_engine
    # the probe steps the model itself before accelerate wraps it: no collective in a step, each rank searches alone
    assert not any(e.probe_runs_collectives for e in (plain, ddp, fsdp, ds))
    # one rank may forward alone in evaluation: one process, or no collectives in forwards
    assert plain.evaluates_alone(True) and ddp.evaluates_alone(False) and not ddp.evaluates_alone(True)
    assert not fsdp.evaluates_alone(False) and Fsdp(trainers[4]).evaluates_alone(False)
    assert not DeepSpeed(trainers[5]).measures_eval_batch(False)
    assert plain.measures_eval_batch(False) and not ddp.measures_eval_batch(True)


def test_chunk_syncs_gradients_in_the_final_forward_only():
    trainer = _Trainer(DistributedType.MULTI_CPU, 2)
    engine = Ddp(trainer)
    with engine.chunk(trainer.model, final=False):
        pass
    with engine.chunk(trainer.model, final=True):
        pass
    assert trainer.accelerator.synced == [False]  # no_sync entered for the non-final forward only
    assert engine.live_model() == "wrapped"


def test_the_engine_holds_its_trainer_weakly():
    trainer = _Trainer()
    engine = Engine(trainer)
    assert engine.trainer is trainer
    del trainer
    assert engine.trainer is None


# the trainer and the planner never ask which engine runs: they import no engine internals
@pytest.mark.parametrize("module", ["trainer/mixin.py", "trainer/checks/construction.py", "trainer/scaled_loss.py",
                                    "trainer/resilience/stopping.py", "window/engine.py", "window/evaluation.py",
                                    "planning/planner.py", "probing/engine.py", "planning/store.py"])
def test_no_engine_branches_outside_the_seam(module):
    tree = ast.parse((ROOT / module).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names if (node.module or "").endswith("compat")}
    assert not imported & {"deepspeed_integration", "parallel"}, module
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not names & {"is_deepspeed_enabled", "is_fsdp_enabled", "distributed_type"}, module
