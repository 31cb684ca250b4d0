"""How the model is parallelized, read from torch and accelerate: accelerate's FSDP, DDP's and FSDP2's
gradient-sync switches, parameters sharded in place or at load time (what `hf_accum/integrations/engines/` reads to tell the
engines apart). Pinned by tests/compat/test_compat.py.
"""

from __future__ import annotations

import contextlib


def accelerate_fsdp(trainer) -> bool:
    """accelerate runs FSDP (``fsdp=``: its distributed type)."""
    from accelerate.utils import DistributedType

    return trainer.accelerator.distributed_type is DistributedType.FSDP


def has_dtensors(model) -> bool:
    """Some parameter is a DTensor (sharded in place: FSDP2, or sharded at load time)."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def is_fsdp2(model) -> bool:
    """`torch.distributed.fsdp.fully_shard` applied: the model is an `FSDPModule` (its forwards all-gather)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def unwrap_parallel(model):
    """The module a DDP wrapper holds (FSDP2 shards in place: the model is itself)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def no_gradient_sync(model):
    """Backward without gradient synchronization, for every micro-batch but a window's last: DDP's `no_sync`, or
    FSDP2's `set_requires_gradient_sync(False)` (restored after)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif is_fsdp2(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def local_shard(t):
    """The part of a tensor this rank holds: a DTensor's (FSDP2) local shard, any other tensor itself."""
    return t.to_local() if type(t).__name__ == "DTensor" else t


def fsdp2_shards(model) -> int | None:
    """Over how many ranks FSDP2 shards ``model``'s parameters (the size of their one-dimensional device mesh); None
    when they are not DTensors, or are sharded over a mesh of more dimensions (HSDP, tensor parallel)."""
    for p in model.parameters():
        if type(p).__name__ == "DTensor":
            mesh = p.device_mesh
            return mesh.size() if mesh.ndim == 1 else None
    return None


def unsharded_class(cls: type) -> type:
    """The model class ``fully_shard`` swapped for its own (`FSDP<Name>`, a subclass of `FSDPModule` and the
    original); any other class itself."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return cls
    if issubclass(cls, FSDPModule):
        return next(b for b in cls.__mro__[1:] if not issubclass(b, FSDPModule))
    return cls


def sharded_at_load(model) -> bool:
    """Sharded by `from_pretrained(..., distributed_config=DistributedConfig(...))` (transformers > 5.17 sets this
    property on the model; older versions cannot shard at load). transformers checkpoints such a model's weights
    but not its optimizer state (`Trainer.__init__` refuses full checkpoints for it: "Resuming is not supported
    for models sharded at load time"), so no checkpoint of such a run can be resumed exactly."""
    return bool(getattr(model, "is_distributed_loading_by_transformers", False))


def refuse_silent_engine_fallback(trainer) -> None:
    """accelerate turns an FSDP request into FSDP only for GPU-like devices: on CPU (`use_cpu=True`) two ranks
    silently run DDP, and with `use_cpu=False` on a machine without GPUs each rank sees world 1 and trains on the
    same data. Both are refused here, before any work."""
    import os

    from accelerate.utils import DistributedType

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and trainer.accelerator.num_processes == 1:
        raise ValueError(
            f"{launched} processes were launched (WORLD_SIZE={launched}) but training sees world size 1: every rank "
            "would train on the same data. On a machine without GPUs pass use_cpu=True (and ddp_backend='gloo'); "
            "otherwise check that each process can see its device."
        )
    if trainer.args.fsdp and trainer.accelerator.distributed_type is not DistributedType.FSDP:
        raise ValueError(
            f"fsdp={trainer.args.fsdp!r} was asked for, but accelerate runs "
            f"{trainer.accelerator.distributed_type.value} (it turns an FSDP request into FSDP only on GPU-like "
            "devices). Unset fsdp to train with DDP on purpose, or shard at load time: "
            "from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=WORLD_SIZE))."
        )
