"""One rank's bytes under a sharding, on paper: plain functions of the parameters' shapes and dtypes, the world, the
sharding and its bucket sizes. No tensors, no devices (the activations come from the one-process step on fake
tensors, `paper_sharded.py`, and are added on top).

FSDP2 (`fully_shard` on every decoder layer, then the root, as accelerate and the Trainer apply it): each rank keeps
its dim-0 shard (padded to the world) of every weight, gradient and AdamW state; in forward and backward the root's
weights stay gathered (the root does not reshard after forward), a decoder layer is gathered while it runs
(``reshard_after_forward=False``: every layer stays gathered from its forward to its
backward); in backward a layer's unsharded gradients, the reduce-scatter's flat input and its output shard are live
together before the layer's gradients are reduced into the shard.

DeepSpeed ZeRO-1/2/3 cannot run on fake tensors: its partitioning and buckets are modelled from its config, as its
own `estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs` count model states (fp32
master weights, fp32 gradients and Adam's two fp32 moments partitioned, 16 or 18 bytes per parameter over the
world), with the buckets (``reduce_bucket_size``, ``allgather_bucket_size``, ZeRO-3's prefetch) and the micro-batch's
activations added. ``offload_optimizer`` moves the partitioned fp32 states to CPU memory (reported apart). As a real
engine holds them (tests/probing/test_zero_real.py): ZeRO-2 allocates its gradient partition and reduce bucket at a
backward's first gradient and frees them in the step, so they add to what is live then, not to the activations'
peak; ZeRO-3 keeps a weight of at most ``stage3_param_persistence_threshold`` elements whole on every rank, and keeps
a gathered weight from its forward to its backward where the step uses it again within ``stage3_max_reuse_distance``
elements (with DeepSpeed's 1e9, every weight of a model under ~500M parameters).

A frozen weight (LoRA's base, QLoRA's quantized base) holds no gradient and no optimizer state anywhere.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

ENGINES = ("fsdp2", "zero1", "zero2", "zero3")
#: DeepSpeed's defaults where its config leaves a size unset or "auto" (elements).
ZERO_DEFAULTS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                 "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
                 "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000}


@dataclass(frozen=True)
class Param:
    """A weight as the model holds it: its shape, bytes per element, trainable or frozen."""

    shape: tuple[int, ...]
    element: int
    trainable: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def shard_numel(self, world: int) -> int:
        """Elements of one rank's dim-0 shard, padded as FSDP2 pads it (dim 0 rounded up to the world)."""
        if not self.shape:
            return 1
        return -(-self.shape[0] // world) * math.prod(self.shape[1:])


@dataclass(frozen=True)
class Counts:
    """The model's weights by FSDP2 unit: each decoder layer's, then the root's (embeddings, final norm, head).
    ``leading``: how many of the root's weights (in the model's order) come before the decoder layers' (the
    embeddings, which run first; the rest, the final norm and the head, run after the layers)."""

    layers: tuple[tuple[Param, ...], ...]
    root: tuple[Param, ...]
    leading: int = 0

    @property
    def params(self) -> tuple[Param, ...]:
        return tuple(p for unit in (*self.layers, self.root) for p in unit)


def full(params, trainable_only: bool = False) -> int:
    return sum(p.numel * p.element for p in params if p.trainable or not trainable_only)


def shard(params, world: int, trainable_only: bool = False) -> int:
    return sum(p.shard_numel(world) * p.element for p in params if p.trainable or not trainable_only)


@dataclass(frozen=True)
class Sharding:
    """``engine``: "fsdp2" or "zero1".."zero3"; ``reshard_after_forward`` (FSDP2); ``offload_optimizer`` (ZeRO: the
    optimizer's fp32 states on CPU); bucket sizes in elements, DeepSpeed's defaults unless its config sets them."""

    engine: str
    reshard_after_forward: bool = True
    offload_optimizer: bool = False
    reduce_bucket_size: int = ZERO_DEFAULTS["reduce_bucket_size"]
    allgather_bucket_size: int = ZERO_DEFAULTS["allgather_bucket_size"]
    prefetch_bucket_size: int = ZERO_DEFAULTS["stage3_prefetch_bucket_size"]
    #: ZeRO-3: a weight of at most this many elements stays whole on every rank (DeepSpeed's "persistent" weights)
    persistence_threshold: int = ZERO_DEFAULTS["stage3_param_persistence_threshold"]
    #: ZeRO-3: at most this many gathered elements; a gathered weight used again within this many is kept
    max_live_parameters: int = ZERO_DEFAULTS["stage3_max_live_parameters"]
    max_reuse_distance: int = ZERO_DEFAULTS["stage3_max_reuse_distance"]

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"sharding={self.engine!r}: give one of {', '.join(ENGINES)} (fsdp2-keep: FSDP2 without "
                             "resharding after forward; zero2+offload: the optimizer on CPU)")
        if self.offload_optimizer and self.engine == "fsdp2":
            raise ValueError("sharding=fsdp2+offload: the estimate models DeepSpeed's optimizer offload only; give "
                             "zero1+offload, zero2+offload or zero3+offload, or fsdp2")

    @property
    def label(self) -> str:
        if self.engine == "fsdp2":
            return "FSDP2" + ("" if self.reshard_after_forward else " (no reshard after forward)")
        return f"ZeRO-{self.engine[-1]}" + (" + optimizer offload" if self.offload_optimizer else "")

    @property
    def modelled(self) -> str:
        """How the engine's bytes are known, said in the output."""
        if self.engine == "fsdp2":
            return ("FSDP2: shards, gathered layers and reduce-scatter buffers counted from the weights' shapes per "
                    "fully_shard unit (each decoder layer, then the root); activations from the step on fake tensors")
        return (f"{self.label}: DeepSpeed cannot run on fake tensors; its partitions (fp32 master weights, fp32 "
                f"gradients, Adam's fp32 moments) and buckets (reduce {self.reduce_bucket_size:,}, allgather "
                f"{self.allgather_bucket_size:,}" + (f", prefetch {self.prefetch_bucket_size:,}"
                                                       if self.engine == "zero3" else "")
                + " elements) modelled from its config; activations from the step on fake tensors")


def parse_sharding(text: str | dict | Sharding) -> Sharding:
    """A `Sharding` from "fsdp2", "fsdp2-keep" (no reshard after forward), "zero1".."zero3" with "+offload", or a
    DeepSpeed config (a dict, or the path of its JSON file: `from_deepspeed`)."""
    if isinstance(text, Sharding):
        return text
    if isinstance(text, dict):
        return from_deepspeed(text)
    name = text.strip().lower()
    if name.endswith(".json"):
        import json

        with open(text) as f:
            return from_deepspeed(json.load(f))
    offload = name.endswith("+offload")
    name = name.removesuffix("+offload")
    if name == "fsdp2-keep":
        return Sharding("fsdp2", reshard_after_forward=False, offload_optimizer=offload)
    return Sharding(name, offload_optimizer=offload)


def from_deepspeed(config: dict[str, Any]) -> Sharding:
    """The ZeRO stage, optimizer offload and bucket sizes of a DeepSpeed config ("auto" or unset: DeepSpeed's
    defaults)."""
    zero = config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    if stage not in (1, 2, 3):
        raise ValueError(f"the DeepSpeed config's zero_optimization.stage is {stage}: the sharded estimate models "
                         "stages 1, 2 and 3")
    offload = (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")

    def size(key: str) -> int:
        value = zero.get(key, "auto")
        return ZERO_DEFAULTS[key] if value in (None, "auto") else int(float(value))

    return Sharding(f"zero{stage}", offload_optimizer=offload, reduce_bucket_size=size("reduce_bucket_size"),
                    allgather_bucket_size=size("allgather_bucket_size"),
                    prefetch_bucket_size=size("stage3_prefetch_bucket_size"),
                    persistence_threshold=size("stage3_param_persistence_threshold"),
                    max_live_parameters=size("stage3_max_live_parameters"),
                    max_reuse_distance=size("stage3_max_reuse_distance"))


@dataclass
class RankBytes:
    """One rank's bytes: what it holds between steps (its shards), what forward and backward add on top of the
    activations (gathered weights, gradient buffers), the optimizer step's, and what sits in CPU memory."""

    weights: int
    gradients: int
    optimizer: int
    gathered: int = 0  # weights gathered while a unit runs (FSDP2 / ZeRO-3)
    gradient_buffers: int = 0  # unsharded gradients, reduce-scatter / reduce-bucket buffers
    optimizer_step: int = 0  # the optimizer step's temporaries (and ZeRO's all-gather of the updated weights)
    cpu: int = 0  # offloaded to CPU memory (not on the card)
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: False where the gradients (and the gradient buffers) are allocated when a backward's first gradient reaches
    #: the engine and freed by the optimizer step (ZeRO-2: the gradient partition, the reduce bucket), not held
    #: between steps
    gradients_held: bool = True

    @property
    def resident(self) -> int:
        """The model states (weights, gradients, optimizer state), as DeepSpeed's own estimators count them."""
        return self.weights + self.gradients + self.optimizer

    @property
    def between_steps(self) -> int:
        """What the rank holds between optimizer steps (`resident` less the gradients where not held)."""
        return self.weights + self.optimizer + (self.gradients if self.gradients_held else 0)

    def peak(self, activations: int, optimizer_temporaries: int, first_gradient: int | None = None) -> int:
        """The rank's peak: the larger of forward + backward (``activations``: the one-process step's bytes above
        its weights and gradients) and the optimizer step (``optimizer_temporaries``: the one-process step's, on
        this rank's share). ``first_gradient``: the one-process step's bytes above its weights and gradients when
        the first gradient is accumulated (unknown: ``activations``, as if at the peak): where the gradients are
        not held (ZeRO-2), they and the buffers are live from then on, on top of what is live then."""
        if self.gradients_held:
            backward = self.resident + activations + self.gathered + self.gradient_buffers
            step = self.resident + self.optimizer_step + optimizer_temporaries
        else:
            late = self.gradients + self.gradient_buffers
            at_first = activations if first_gradient is None else first_gradient
            backward = self.between_steps + self.gathered + max(activations, at_first + late)
            step = self.between_steps + self.gradients + self.optimizer_step + optimizer_temporaries
        return max(backward, step)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "resident": self.resident, "between_steps": self.between_steps}


def rank_bytes(counts: Counts, sharding: Sharding, world: int) -> RankBytes:
    """One rank's bytes under ``sharding`` at ``world`` ranks (optimizer: AdamW, two moments per trainable weight,
    in the weight's dtype under FSDP2 as torch's AdamW keeps them, fp32 under ZeRO as DeepSpeed keeps them)."""
    if world < 1:
        raise ValueError(f"world={world}: give a number of GPUs >= 1")
    if sharding.engine == "fsdp2":
        return _fsdp2(counts, sharding, world)
    return _zero(counts, sharding, world)


def _fsdp2(counts: Counts, sharding: Sharding, world: int) -> RankBytes:
    params = counts.params
    layers = counts.layers
    gathered = full(counts.root)
    if layers:
        biggest = max(full(unit) for unit in layers)
        # at the head of backward, where the micro-batch's activations peak: the root and the layer whose backward
        # runs first (resharding after forward), else every layer, still gathered since its forward
        gathered += biggest if sharding.reshard_after_forward else sum(full(u) for u in layers)
    # a layer's backward: its unsharded gradients, the reduce-scatter's flat input (a copy) and its output shard
    buffers = max((2 * full(unit, True) + shard(unit, world, True) for unit in layers), default=0)
    return RankBytes(weights=shard(params, world), gradients=shard(params, world, True),
                     optimizer=2 * shard(params, world, True), gathered=gathered, gradient_buffers=buffers)


def _zero(counts: Counts, s: Sharding, world: int) -> RankBytes:
    params = counts.params
    stage = int(s.engine[-1])
    trainable = sum(p.numel for p in params if p.trainable)
    bit16 = full(params, True)  # the trainable weights in their own dtype (DeepSpeed's "bit16" groups)
    element = max((p.element for p in params if p.trainable), default=4)
    part = -(-trainable // world)  # one rank's partition of the flat trainable weights (elements)
    fp32_grads = 4 * part if element < 4 else 0  # a half-precision gradient partition is upcast for the step
    states = 4 * part + 8 * part + fp32_grads  # fp32 master weights, Adam's two moments, fp32 gradients
    frozen = full(params) - bit16
    if stage == 3:
        # every weight's partition; a persistent weight (at most persistence_threshold elements) also whole
        persistent = sum(p.numel * p.element for p in params if p.numel <= s.persistence_threshold)
        weights = -(-(bit16 + frozen) // world) + persistent
        gathered = _zero3_gathered(counts, s, element)
    else:
        weights, gathered = bit16 + frozen, 0
    gradients = 0 if s.offload_optimizer else (bit16 if stage == 1 else element * part)
    reduce = element * min(s.reduce_bucket_size, trainable)
    allgather = element * min(s.allgather_bucket_size, trainable) if stage < 3 else 0
    on_card = 0 if s.offload_optimizer else states
    # ZeRO-2 allocates its gradient partition and reduce bucket at a backward's first gradient (`setup_buckets`,
    # `copy_grads_in_partition`) and frees them in the step; ZeRO-1 keeps whole gradients, ZeRO-3 a flat partition
    held = stage != 2 or s.offload_optimizer
    return RankBytes(weights=weights, gradients=gradients, optimizer=on_card, gathered=gathered,
                     gradient_buffers=reduce, optimizer_step=allgather, cpu=states if s.offload_optimizer else 0,
                     notes=("optimizer step on CPU (DeepSpeed's CPU Adam)",) if s.offload_optimizer else (),
                     gradients_held=held)


def _zero3_gathered(counts: Counts, s: Sharding, element: int) -> int:
    """ZeRO-3's gathered (non-persistent) weights at the head of backward, where the activations peak. DeepSpeed
    releases a weight after its module ran unless the step's trace uses it again within ``max_reuse_distance``
    elements: a unit's forward and backward are about twice the elements of the units after it apart, so the last
    units stay gathered from their forward to their backward; the rest are gathered while they run, with the
    prefetch bucket's elements ahead. At most ``max_live_parameters`` elements. Forward order: the root's leading
    weights (the embeddings), the decoder layers, the rest of the root (the final norm, the head), each of the
    root's weights its own module."""
    root = [(p,) for p in counts.root]
    units = [*root[:counts.leading], *counts.layers, *root[counts.leading:]]

    def gathered(unit) -> int:
        return sum(p.numel * p.element for p in unit if p.numel > s.persistence_threshold)

    after, kept_bytes, released = 0, 0, []
    for unit in reversed(units):
        nbytes = gathered(unit)
        if 2 * after < s.max_reuse_distance:
            kept_bytes += nbytes
        else:
            released.append(nbytes)
        after += sum(p.numel for p in unit)
    # a released unit gathered while it runs, with the prefetch bucket's elements ahead of it
    running = min(max(released) + s.prefetch_bucket_size * element, sum(released)) if released else 0
    biggest = max((gathered(unit) for unit in units), default=0)
    return min(kept_bytes + running, max(s.max_live_parameters * element, biggest))


def rank_peak(counts: Counts, sharding: Sharding, world: int, activations: int, optimizer_temporaries: int,
              first_gradient: int | None = None) -> int:
    """The rank's predicted peak (`RankBytes.peak`); the one-process optimizer temporaries are shared over the world
    (AdamW's temporaries span the parameters it steps, and each rank steps its shard; ZeRO with offload steps on
    CPU). ``first_gradient``: the one-process step's bytes when its first gradient is accumulated
    (`paper_sharded.FakeSteps.first_gradient`; None: counted as at the activations' peak)."""
    rb = rank_bytes(counts, sharding, world)
    temporaries = 0 if sharding.offload_optimizer else -(-optimizer_temporaries // world)
    return rb.peak(activations, temporaries, first_gradient)


def deepspeed_model_states(total_params: int, largest_layer_params: int, world: int, stage: int,
                           offload: bool) -> int:
    """DeepSpeed's own per-GPU figure for the model states (`estimate_zero2_model_states_mem_needs`,
    `estimate_zero3_model_states_mem_needs`, deepspeed/runtime/zero/stage_1_and_2.py and stage3.py, fp16 weights):
    ZeRO-2 2P + 18P/N (offload: 2P); ZeRO-3 4L + 18P/N (offload of the optimizer: 4L + 2P/N); no activations, no
    buffers."""
    if stage == 3:
        return 4 * largest_layer_params + int((2 if offload else 18) * total_params / world)
    return 2 * total_params + (0 if offload else int(18 * total_params / world))
