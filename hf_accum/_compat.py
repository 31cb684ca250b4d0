"""The one place that knows how transformers' `Trainer.training_step` post-processes the loss.

`training_step` divides the value returned by `compute_loss` by the number of micro-batches in the window
unless it believes the loss is already normalized for accumulation. The rule changed between versions:
- transformers 5.17: divides iff `(not model_accepts_loss_kwargs or num_items_in_batch is None)
  and compute_loss_func is None`;
- transformers >= 5.2x: a class attribute `loss_is_scaled_for_ga` overrides that rule when not None.
`tests/test_compat.py` fails when a new version changes this, and `AccumTrainer` checks the returned value
of its first training step against this prediction at run time.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import Trainer

# Older versions ignore the attribute even when a subclass sets it.
HAS_LOSS_IS_SCALED_FOR_GA = hasattr(Trainer, "loss_is_scaled_for_ga")


def trainer_divides_by_accumulation(trainer, num_items_in_batch) -> bool:
    declared = getattr(trainer, "loss_is_scaled_for_ga", None) if HAS_LOSS_IS_SCALED_FOR_GA else None
    if declared is not None:
        return not declared
    scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
        trainer.compute_loss_func is not None
    )
    return not scaled


def checkpointing_enabled(args) -> bool:
    """Gradient checkpointing asked for, under either name (5.23 renamed it "activation checkpointing")."""
    flag = getattr(args, "activation_checkpointing", None)
    return bool(flag if flag is not None else args.gradient_checkpointing)


def enable_checkpointing(model, args) -> None:
    """Turn on gradient checkpointing as `Trainer.train()` will, so a probe that runs before `train()` measures
    the memory training will use. Idempotent."""
    if not checkpointing_enabled(args):
        return
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs or {}
    kwargs = {k: v for k, v in kwargs.items() if k not in ("every_n_layers", "offload")}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


# --- per-layer checkpointing ---------------------------------------------------------------------------------
# transformers (5.17 and 5.24 alike) checkpoints a decoder layer when its class derives from
# `transformers.modeling_layers.GradientCheckpointingLayer` and the instance's `gradient_checkpointing` flag is True
# (in training, with grad enabled), through the `_gradient_checkpointing_func` that `*_checkpointing_enable` sets on
# every module carrying the flag. `every_n_layers` picks evenly spaced layers; hf_accum sets the flags itself to
# checkpoint exactly k layers, the first k: their recompute runs after the later layers' activations are freed in
# the backward, so it does not add to the peak (tests/test_compat.py pins the flag and the enable path).
def checkpoint_owner(model):
    """The module whose `activation_checkpointing_enable` / `gradient_checkpointing_enable` applies (through peft's
    wrappers, which forward attribute access to the transformers model); None when there is none."""
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        method = getattr(model, name, None)
        if callable(method):
            return getattr(method, "__self__", model)
    return None


def checkpointable_layers(model) -> list:
    """The decoder layers transformers checkpoints one by one (`GradientCheckpointingLayer` instances, in forward
    order), through peft wrappers; [] when the model has none (then checkpointing is on or off only)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - both supported versions have it
        return []
    if checkpoint_owner(model) is None:
        return []
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def can_checkpoint(model) -> bool:
    """Whether checkpointing can be switched on for ``model`` at all."""
    owner = checkpoint_owner(model)
    return owner is not None and getattr(owner, "supports_gradient_checkpointing", True) is not False


def checkpoint_levels(model) -> int:
    """How many levels of checkpointing exist: L for L checkpointable layers, 1 for on/off only, 0 for none."""
    if not can_checkpoint(model):
        return 0
    return len(checkpointable_layers(model)) or 1


def checkpoint_kwargs(args) -> dict:
    """The user's checkpointing kwargs for `torch.utils.checkpoint` (either name), without transformers' own keys."""
    kwargs = (getattr(args, "activation_checkpointing_kwargs", None) or getattr(args, "gradient_checkpointing_kwargs",
                                                                                   None) or {})
    return {k: v for k, v in dict(kwargs).items() if k not in ("every_n_layers", "offload")}


def _enable_all(model, kwargs: dict | None) -> None:
    owner = checkpoint_owner(model)
    if owner is None or not can_checkpoint(model):
        raise ValueError(f"{type(model).__name__} cannot checkpoint activations (it has no "
                         "activation_checkpointing_enable / gradient_checkpointing_enable).")
    if hasattr(owner, "activation_checkpointing_enable"):
        owner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
    else:
        owner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


def _disable_all(model) -> None:
    owner = checkpoint_owner(model)
    if owner is None:
        return
    if hasattr(owner, "activation_checkpointing_disable"):
        owner.activation_checkpointing_disable()
    elif hasattr(owner, "gradient_checkpointing_disable"):
        owner.gradient_checkpointing_disable()


def checkpointed_count(model) -> int:
    """How many levels recompute now: checkpointed layers, or 1/0 for an on/off model."""
    layers = checkpointable_layers(model)
    if layers:
        return sum(bool(getattr(m, "gradient_checkpointing", False)) for m in layers)
    return int(any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()))


def set_checkpointed_layers(model, k: int, kwargs: dict | None = None) -> None:
    """Exactly ``k`` of the model's L levels recompute in the backward (`checkpoint_levels`): k=0 switches
    checkpointing off, k=L on for every layer, 0<k<L the first k decoder layers. For k>0 transformers' own enable runs
    first (it sets the checkpoint function, ``kwargs`` for `torch.utils.checkpoint`, and the input-embedding hook that
    makes frozen embeddings' output require grad, which LoRA needs with reentrant checkpointing)."""
    levels = checkpoint_levels(model)
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= levels:
        raise ValueError(f"{type(model).__name__} has {levels} checkpointable layers; cannot checkpoint {k!r}")
    if k == 0:
        if checkpointed_count(model):
            _disable_all(model)
        return
    _enable_all(model, kwargs)
    for index, layer in enumerate(checkpointable_layers(model)):
        layer.gradient_checkpointing = index < k


_CHECKPOINT_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func")


@contextlib.contextmanager
def checkpointed_layers(model, k: int, kwargs: dict | None = None):
    """`set_checkpointed_layers(model, k, kwargs)` for the block (a probe trial), then every module's checkpointing
    flag and function and the input-embedding hooks exactly as they were, even on error."""
    saved = [(m, {a: m.__dict__[a] for a in _CHECKPOINT_ATTRS if a in m.__dict__}) for m in model.modules()]
    hooks = {id(m): list(getattr(m, "_require_grads_hooks", None) or []) for m in model.modules()}
    try:
        set_checkpointed_layers(model, k, kwargs)
        yield
    finally:
        for module, attrs in saved:
            for name in _CHECKPOINT_ATTRS:
                if name in attrs:
                    module.__dict__[name] = attrs[name]
                else:
                    module.__dict__.pop(name, None)
        for module in model.modules():
            before = hooks.get(id(module), [])
            now = getattr(module, "_require_grads_hooks", None)
            if now is None or now == before:
                continue
            for hook in now:
                if all(hook is not b for b in before):
                    hook.remove()
            module._require_grads_hooks = before
            if before:
                module._require_grads_hook = before[0]
            else:
                module.__dict__.pop("_require_grads_hook", None)



@contextlib.contextmanager
def printers_muted(trainer):
    """transformers' console callbacks (`ProgressCallback`, `PrinterCallback`) print every dict `Trainer.log` sends.
    The plan's figures are for `log_history` and the `report_to` integrations (the one plan line already said it), so
    for that one call the handler's `callbacks` list leaves them out."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    handler = trainer.callback_handler
    kept = handler.callbacks
    handler.callbacks = [c for c in kept if not isinstance(c, PrinterCallback | ProgressCallback)]
    try:
        yield
    finally:
        handler.callbacks = kept


def main_input_tokens(trainer, inputs) -> int:
    """Token positions of the main input, as the Trainer counts them (`Trainer._track_num_input_tokens`, the
    model's `floating_point_ops`); 0 when the batch has none."""
    main = getattr(trainer.model, "main_input_name", "input_ids")
    value = inputs.get(main) if isinstance(inputs, dict) else None
    return int(value.numel()) if torch.is_tensor(value) else 0


def add_input_tokens_seen(trainer, local_tokens: int) -> None:
    """What `Trainer._track_num_input_tokens` does with its count (summed over ranks into the state); the
    Trainer's loop calls that method with each loaded batch, which `AccumulationMixin` overrides."""
    tokens = torch.as_tensor(local_tokens, device=trainer.args.device, dtype=torch.int64)
    trainer.state.num_input_tokens_seen += trainer.accelerator.gather(tokens).sum().item()


def window_policy(trainer, collectives_in_compute_loss: bool):
    """``stop`` where some forward or backward runs collectives, so one rank may not skip it: FSDP / DeepSpeed
    (accelerate's distributed type), parameters already sharded as DTensors (FSDP2 applied at load), or a
    trainer whose `compute_loss` gathers metrics; ``rerun`` otherwise (one process, DDP)."""
    from accelerate.utils import DistributedType

    from .protocol import Policy

    sharded_engine = trainer.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    dtensor = any(type(p).__name__ == "DTensor" for p in trainer.model.parameters())
    return Policy.STOP if sharded_engine or dtensor or collectives_in_compute_loss else Policy.RERUN


def world_size() -> int:
    """Ranks of the default process group (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def default_store():
    """The default process group's key-value store (the launcher's TCPStore under torchrun, which outlives any one
    rank), or None without a process group. torch keeps it private: `distributed_c10d._get_default_store`."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


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


# --- Trainer internals the engine and the check read ----------------------------------------------------------
def window_length(trainer) -> int:
    """Micro-batches in the current window: `Trainer.training_step` divides the loss by this private attribute
    (set by `_inner_training_loop` per window); `tests/test_compat.py` pins that it is the divisor."""
    return trainer.current_gradient_accumulation_steps


@contextlib.contextmanager
def window_length_set(trainer, length: int):
    """Set it for steps run outside the Trainer's loop (the accumulation check), restored after."""
    saved = trainer.__dict__.get("current_gradient_accumulation_steps", _MISSING)
    trainer.current_gradient_accumulation_steps = length
    try:
        yield
    finally:
        if saved is _MISSING:
            del trainer.current_gradient_accumulation_steps
        else:
            trainer.current_gradient_accumulation_steps = saved


_MISSING = object()


def prepare_inputs(trainer, batch):
    """Move a collated batch to the device as the training loop does (`Trainer._prepare_inputs`)."""
    return trainer._prepare_inputs(batch)


@contextlib.contextmanager
def trl_metrics_untouched(trainer):
    """TRL trainers append to `_metrics` and count `_total_train_tokens` in `compute_loss`; the probe's and the
    accumulation check's steps are not training, so both are restored after them."""
    import copy

    metrics = copy.deepcopy(trainer.__dict__.get("_metrics"))
    tokens = trainer.__dict__.get("_total_train_tokens")
    try:
        yield
    finally:
        if metrics is not None:
            trainer._metrics = metrics
        if tokens is not None:
            trainer._total_train_tokens = tokens


def trl_metrics_kept(method):
    """``method`` of a trainer run under `trl_metrics_untouched` (a no-op for trainers that keep no TRL metrics)."""
    import functools

    @functools.wraps(method)
    def wrapped(trainer, *args, **kwargs):
        with trl_metrics_untouched(trainer):
            return method(trainer, *args, **kwargs)

    return wrapped


def kineto_events(prof):
    """The finished profiler's raw kineto events (the `[memory]` events the CPU meter replays)."""
    return prof.profiler.kineto_results.events()

def attn_implementation(model) -> str | None:
    """The attention kernel the model runs (eager, sdpa, flash_attention_2, ...): it changes a step's memory.
    transformers keeps it in the config's private `_attn_implementation` (5.17 to 5.23)."""
    config = getattr(model, "config", None)
    value = getattr(config, "_attn_implementation", None) if config is not None else None
    return None if value is None else str(value)


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


def deepspeed_enabled(trainer) -> bool:
    """The Trainer resumes through DeepSpeed's engine (`Trainer.is_deepspeed_enabled`, set from accelerate's state)."""
    return bool(getattr(trainer, "is_deepspeed_enabled", False))


def local_shard(t):
    """The part of a tensor this rank holds: a DTensor's (FSDP2) local shard, any other tensor itself."""
    return t.to_local() if type(t).__name__ == "DTensor" else t


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
# --- torch's chunked linear + cross-entropy (fused_loss.py) -------------------------------------------------------
# torch 2.13 added `F.linear_cross_entropy(..., options=LinearCrossEntropyOptions(...))`: a chunked path that never
# builds the (rows, vocab) logits and computes the gradients inside the forward. Older torch (the supported range
# starts at 2.6) has neither; fused_loss.py then uses its own checkpointed chunks.
HAS_LINEAR_CROSS_ENTROPY = hasattr(torch.nn.functional, "linear_cross_entropy") and hasattr(
    torch.nn, "LinearCrossEntropyOptions"
)


def linear_cross_entropy_sum(hidden, weight, bias, targets, rows: int):
    """Sum over rows of cross_entropy(hidden @ weight.T + bias, targets) on torch's chunked path, ``rows`` rows per
    chunk. Raises instead of silently building the full logits when torch declines the chunked path."""
    import warnings

    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=rows, chunking_method=None)
    with warnings.catch_warnings():
        # torch warns and falls back to the full-logits reference when it cannot chunk: that would be the memory
        # this path exists to avoid, so make it an error (it means torch changed what it supports).
        warnings.filterwarnings("error", message=".*options.*ignored", category=UserWarning)
        return torch.nn.functional.linear_cross_entropy(
            hidden, weight, targets, linear_bias=bias, reduction="sum", ignore_index=-100, options=options
        )


def is_autocast_enabled(device_type: str) -> bool:
    return torch.is_autocast_enabled(device_type)


def deepspeed_zero3_enabled() -> bool:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


# --- TRL (trl.py) -----------------------------------------------------------------------------------------------
def trl_fuses_lm_head() -> bool:
    """Whether TRL's SFTTrainer computes its loss through `add_fused_lm_head` (a patched `model.forward` called with
    `fused_lm_head=True`, TRL >= 1.x) rather than from the model's logits."""
    try:
        from trl.trainer import utils
    except ImportError:
        return False
    return hasattr(utils, "add_fused_lm_head")


def engine_steps_in_backward(trainer) -> bool:
    """DeepSpeed's engine takes the optimizer step inside `backward` at the accumulation boundary."""
    from accelerate.utils import DistributedType

    return trainer.accelerator.distributed_type is DistributedType.DEEPSPEED


# --- DeepSpeed (through transformers' and accelerate's integration) ---------------------------------------------
def deepspeed_user_config(value) -> dict:
    """The DeepSpeed config as the user gave it (`TrainingArguments.deepspeed`: a dict, a JSON file's path or a JSON
    string), "auto" fields intact; parsed by accelerate's `HfDeepSpeedConfig`, which copies and never fills."""
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    return HfDeepSpeedConfig(value).config


def deepspeed_stage(trainer) -> int | None:
    """The ZeRO stage of the engine accelerate builds; None when DeepSpeed is not in use."""
    if not engine_steps_in_backward(trainer):
        return None
    return int(trainer.accelerator.state.deepspeed_plugin.zero_stage)


def engine_label(trainer) -> str | None:
    """The sharded engine a plan runs on, as plans and plan keys name it ("DeepSpeed ZeRO-3"); None otherwise."""
    from .deepspeed_batch import engine_name

    stage = deepspeed_stage(trainer)
    return None if stage is None else engine_name(stage)


def fill_deepspeed_config(trainer) -> None:
    """Make the config accelerate builds the DeepSpeed engine from (in `train()`) hold the plan now in the arguments.

    transformers fills a config's "auto" fields once, in `TrainingArguments.__post_init__`, from the batch settings
    given then (before any plan: micro 8 × accumulation 1 for a tuned run); accelerate's `_prepare_deepspeed`
    reads `deepspeed_plugin.hf_ds_config` / `deepspeed_config`. As transformers' own hyperparameter search does, a
    fresh `HfTrainerDeepSpeedConfig` of the user's config ("auto" intact) is filled from the current arguments and
    replaces both (and `args.hf_deepspeed_config`, which `is_deepspeed_zero3_enabled` reads through a weakref)."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    args = trainer.args
    config = HfTrainerDeepSpeedConfig(args.deepspeed)
    config.trainer_config_process(args)
    args.hf_deepspeed_config = config
    plugin = trainer.accelerator.state.deepspeed_plugin
    plugin.hf_ds_config = config
    plugin.deepspeed_config = config.config


def deepspeed_batch_config(trainer) -> dict:
    """The config accelerate will build (or built) the engine from."""
    return trainer.accelerator.state.deepspeed_plugin.deepspeed_config


@contextlib.contextmanager
def engine_boundary(trainer, final: bool):
    """One chunk's backward under DeepSpeed, with the engine's accumulation boundary set to ``final``.

    accelerate's `DeepSpeedEngineWrapper.backward` sets the engine's boundary from `accelerator.sync_gradients` and
    calls `engine.step()` when it is true; transformers sets `sync_gradients` per *loaded* batch. When hf_accum cuts
    the window's last loaded batch into chunks (OOM recovery, token budgets), every chunk would step; so it is set
    per chunk: true for the window's final chunk only (the engine then steps exactly once per window whatever the
    cut), restored after. DeepSpeed's own micro-step counter is never relied on."""
    if not engine_steps_in_backward(trainer):
        yield
        return
    state = trainer.accelerator.gradient_state
    saved = state.sync_gradients
    state._set_sync_gradients(final)
    try:
        yield
    finally:
        state._set_sync_gradients(saved)


def deepspeed_engine(trainer):
    """The live DeepSpeed engine `train()` built (`Trainer.model_wrapped`, also kept as `trainer.deepspeed`)."""
    return trainer.model_wrapped


# What `DeepSpeedEngine.load_checkpoint` does not put back: its micro-step counter (the others are in the checkpoint).
_ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


@contextlib.contextmanager
def deepspeed_state_restored(trainer, scratch: str):
    """Run the block (the probe's real steps through the engine), then put the engine back as it was: weights (its
    fp32 master partitions and the module's), optimizer state, its LR scheduler and its step counters. ZeRO keeps
    these in its own partitions, so they are saved and loaded the way transformers resumes a DeepSpeed run
    (`engine.save_checkpoint` / `load_checkpoint`, every rank, collectively) into ``scratch``, removed after.

    Restored only when the block ends normally: after an error some rank may sit in a collective, and the run
    stops anyway (the user's own checkpoints are never touched)."""
    import shutil

    from transformers.trainer import _is_peft_model

    engine = deepspeed_engine(trainer)
    counters = {name: getattr(engine, name) for name in _ENGINE_COUNTERS}
    tag = "hf_accum_probe"
    engine.save_checkpoint(scratch, tag=tag)
    try:
        yield
    except BaseException:
        if trainer.args.should_save:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    load_path, _ = engine.load_checkpoint(scratch, tag=tag, load_module_strict=not _is_peft_model(trainer.model),
                                          load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"hf_accum: DeepSpeed could not load back the state saved before the probe ({scratch})")
    for name, value in counters.items():
        setattr(engine, name, value)
    torch.distributed.barrier()  # every rank has read its partition before the folder goes
    if trainer.args.should_save:
        shutil.rmtree(scratch, ignore_errors=True)


def deepspeed_buckets(trainer) -> dict[str, int]:
    """The sizes, in elements, of the communication buffers the live engine's ZeRO optimizer allocates, by the
    DeepSpeed config key that sets each (DeepSpeed's defaults, 5e8 for ZeRO-1/2, where the config sets none)."""
    zero = deepspeed_engine(trainer)._config.zero_config
    stage = int(zero.stage)
    if stage == 0:
        return {}
    if stage < 3:
        return {"reduce_bucket_size": int(zero.reduce_bucket_size), "allgather_bucket_size": int(zero.allgather_bucket_size)}
    return {"reduce_bucket_size": int(zero.reduce_bucket_size), "stage3_prefetch_bucket_size": int(zero.prefetch_bucket_size)}


def set_deepspeed_batch(trainer, micro: int, accumulation: int) -> None:
    """The plan on the live engine, through its own setters (the micro-batch first: `set_train_batch_size` keeps
    it and derives the accumulation), and in the config accelerate and the arguments hold, which is what is saved.
    hf_accum still sets the accumulation boundary per chunk (`engine_boundary`): the engine's counter is only
    what it reports."""
    engine = deepspeed_engine(trainer)
    engine.set_train_micro_batch_size(micro)
    engine.set_train_batch_size(micro * accumulation * engine.dp_world_size)
    for config in {id(c): c for c in (deepspeed_batch_config(trainer), trainer.args.hf_deepspeed_config.config)}.values():
        config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation,
                      train_batch_size=engine.train_batch_size())


# --- evaluation (hf_accum/evaluation.py) ----------------------------------------------------------------------
@contextlib.contextmanager
def prediction_loss_counted(trainer, num_items):
    """Inside, the `compute_loss` calls of a `prediction_step` get ``num_items`` as `num_items_in_batch`:
    transformers' (5.17 to 5.24) passes its own count there (`_get_num_items_in_batch`, gathered over ranks when
    `average_tokens_across_devices` is on); TRL's passes none, and `Trainer.training_step` always passes it, so
    every `compute_loss` accepts it. Yields what each call returned as its loss; None is appended for a call that
    gave the count positionally, whose loss hf_accum then cannot drive. ``num_items`` None: only records."""
    original = trainer.compute_loss
    seen: list = []

    def compute_loss(model, inputs, *args, **kwargs):
        driven = len(args) < 2  # (return_outputs, num_items_in_batch) positionally: not ours to replace
        if driven and num_items is not None:
            kwargs["num_items_in_batch"] = num_items
        out = original(model, inputs, *args, **kwargs)
        seen.append((out[0] if isinstance(out, tuple) else out) if driven else None)
        return out

    trainer.compute_loss = compute_loss
    try:
        yield seen
    finally:
        del trainer.compute_loss


def eval_rows_kept(trainer, rows: int) -> tuple[int, int | None]:
    """(how many of this rank's ``rows``, the eval batch being run, `Accelerator.gather_for_metrics` keeps; the row
    at which every rank cuts its last batch when some rank keeps only part of its own, else None).

    With several ranks and `even_batches`, accelerate completes the ranks' last batches with samples from the start
    of the data set, all of one size, and at the end of the dataloader keeps the first `gradient_state.remainder`
    gathered rows (rank 0's batch, then rank 1's, ...); transformers' eval_loss and predictions drop the rest. The
    cut is the same on every rank (the remainder modulo the batch), so every rank runs as many forwards."""
    accelerator = trainer.accelerator
    state = accelerator.gradient_state
    if accelerator.num_processes == 1 or not getattr(accelerator, "even_batches", True):
        return rows, None
    if not state.end_of_dataloader or state.remainder is None or state.remainder <= 0 or rows == 0:
        return rows, None
    kept = max(0, min(rows, state.remainder - accelerator.process_index * rows))
    return kept, (state.remainder % rows or None)
