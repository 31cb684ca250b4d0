"""`AccumTrainingArguments`: `TrainingArguments` plus the fields hf_accum adds.

Every field carries `metadata={"help": ...}` so `HfArgumentParser` turns it into a CLI flag and a YAML key;
every check runs in `__post_init__`, before a model is loaded, and its message names the argument and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments

from .config.arg_checks import (
    DEFAULT_MAX_NONFINITE_STEPS,
    check_intervals,
    is_number,
    parse_nonfinite_limit,
    require_bool,
    require_positive,
    suggest_accumulation,
)
from .config.settings import Settings, field_default
from .levers.checkpointing import parse_layers
from .levers.kernels import liger
from .window.loss import NORMALIZATIONS

# transformers 5.17 declares `gradient_checkpointing: bool = False`, so an explicit False cannot be told from the default;
# 5.24 declares `activation_checkpointing: bool | None = None` (and the old name as its alias, also None). Where the
# default is not None it is overridden to None: "unset" lets the tuner choose (checkpoint_layers="auto").
_FLAG_DEFAULT_IS_NONE = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}.get(
    "gradient_checkpointing") is None


# the token limits TRL's configs declare (checked where the config has them)
_TOKEN_LIMITS = ("max_length", "max_prompt_length", "max_completion_length")


@dataclass
class AccumTrainingArguments(TrainingArguments):
    if not _FLAG_DEFAULT_IS_NONE:  # pragma: no cover - transformers < 5.23 (ci/oldest-constraints.txt)
        gradient_checkpointing: bool | None = field(
            default=None,
            metadata={
                "help": "Gradient checkpointing on every layer (True) or none (False). Unset: with the auto-tuner, "
                        "checkpoint_layers='auto' chooses; without it, off.",
                "nargs": "?",
                "const": True,
            },
        )
    target_batch_size: int | None = field(
        default=None,
        metadata={
            "help": (
                "Effective batch: samples per optimizer step summed over all micro-batches and all data-parallel "
                "ranks. Must equal per_device_train_batch_size x gradient_accumulation_steps x world size "
                "unless the auto-tuner chooses the micro-batch. Unset: derived from those three."
            )
        },
    )
    loss_normalization: str = field(
        default="tokens",
        metadata={
            "help": (
                "How the loss of one optimizer step is normalized. 'tokens': sum of token losses over every "
                "counted label (-100 ignored, causal shift respected) of the whole effective batch, divided by "
                "their number, exactly, whatever the model, loss code or data-parallel setup. 'samples': mean "
                "over the samples of the effective batch (one target per sample, e.g. classification). "
                "'model': transformers' own behaviour, untouched."
            ),
            "choices": list(NORMALIZATIONS),
        },
    )
    check_accumulation: bool = field(
        default=False,
        metadata={
            "help": (
                "Run trainer.check_accumulation() at the start of train(): compares the gradient of k "
                "micro-batches with one pass over the same samples on your model and data, restores every "
                "gradient, weight and RNG state, and warns when the relative error exceeds the tolerance."
            )
        },
    )
    auto_tune: bool = field(
        default=True,
        metadata={
            "help": (
                "With target_batch_size set: before training, measure the peak memory of real training steps and "
                "choose per_device_train_batch_size and gradient_accumulation_steps (values you pass for them are "
                "ignored, with a log line). The plan is written to output_dir and reused while nothing that "
                "changes memory changes. Off: the two are used as given and must multiply to the target."
            )
        },
    )
    memory_budget: float = field(
        default=0.9,
        metadata={
            "help": (
                "Memory the auto-tuner may plan for: a fraction (0, 1] of the memory this process can use when "
                "training starts (the device's capacity minus what other processes hold); the rest is the margin."
            )
        },
    )
    memory_budget_bytes: int | None = field(
        default=None,
        metadata={"help": "Memory budget in bytes; overrides memory_budget when set."},
    )
    probe_seq_len: int | None = field(
        default=None,
        metadata={
            "help": (
                "Sequence length the probe measures at (causal LMs). Unset: the longest training example after "
                "collation, the worst case training will meet."
            )
        },
    )
    probe_max_micro_batch: int | None = field(
        default=None,
        metadata={"help": "Largest micro-batch the probe may try. Unset: the per-rank target."},
    )
    probe_from_estimate: bool = field(default=True, metadata={"help": (
        "Start the probe's search at the largest micro-batch the estimate predicts (fake tensors: the model rebuilt "
        "from its config, nothing allocated; skipped with one log line where it cannot be made). The plan is always "
        "the measured one; False: the search starts from micro-batch 1.")})
    auto_tune_optimize: str = field(
        default="memory",
        metadata={
            "help": (
                "'memory': the largest micro-batch that fits (each window cut into the fewest near-equal "
                "forwards). 'throughput': time every fitting size that gives a different number of forwards and "
                "take the fastest (more probe steps). With checkpoint_layers='auto' the lever already chooses by "
                "measured step time, and 'throughput' adds nothing."
            ),
            "choices": ["memory", "throughput"],
        },
    )
    fused_loss: bool | None = field(
        default=None,
        metadata={
            "help": (
                "Causal-LM training loss computed from the last hidden states and the LM head's weight in chunks, "
                "never materializing the logits (same loss and gradient; far less memory at large vocabularies, "
                "hence a larger planned micro-batch). Unset: on where supported, off otherwise (one log line says "
                "which and why). True: required, an error names the reason where unsupported (a LoRA adapter or "
                "modules_to_save copy on lm_head, logit softcapping/scaling, an extra loss term such as an MoE router "
                "loss, label smoothing, compute_loss_func, a compute_loss override, FSDP/ZeRO-3). False: the model's "
                "own loss from the full logits. Training only: evaluation always gets the logits."
            )
        },
    )
    check_accumulation_tolerance: float | None = field(
        default=None,
        metadata={
            "help": (
                "Relative gradient error above which check_accumulation warns. Unset: chosen from the "
                "parameter dtype and mixed-precision settings (float64 1e-6, float32 1e-4, bf16/fp16 5e-2)."
            )
        },
    )
    micro_batching: str = field(
        default="samples",
        metadata={
            "help": (
                "'samples': every forward holds micro_batch_size samples padded to their longest (sized for the "
                "worst-case example). 'tokens': each rank loads its whole window (target / world samples, the "
                "same samples and windows as 'samples'), sorts it by length and cuts it into the fewest forwards "
                "whose rows x padded length fit a token budget the probe measures (max_tokens_per_forward without "
                "auto_tune); exact like 'samples', with less padding and fewer forwards on long-tailed data."
            ),
            "choices": ["samples", "tokens"],
        },
    )
    max_tokens_per_forward: int | None = field(
        default=None,
        metadata={"help": "micro_batching='tokens' with auto_tune off: the token budget of one forward."},
    )
    checkpoint_layers: str | None = field(
        default=None,
        metadata={
            "help": (
                "How many decoder layers recompute their activations in the backward (gradient checkpointing per "
                "layer). 'auto' (the default whenever gradient_checkpointing / activation_checkpointing is unset): "
                "with the auto-tuner, the probe measures steps without and with checkpointing, and picks the number "
                "of layers k and the micro-batch that reach the target in the least time within the memory budget "
                "(verified by a real step); without the tuner, off. An integer k: exactly the first k layers (0: "
                "off; a model without per-layer support takes 0 or 1). An explicit gradient_checkpointing=True/False "
                "is obeyed as given (every layer / none); beside an integer k > 0 either is refused as a contradiction."
            )
        },
    )
    levers: str | None = field(
        default=None,
        metadata={
            "help": (
                "Pin levers to a level: comma-separated name=value, e.g. 'checkpointing=2' or "
                "'selective=4,checkpointing=2' (the first 2 layers recompute fully, the next 4 selectively). A value "
                "is 'auto' (the probe chooses by measured step time), 'off', or the lever's level; a lever not named "
                "is 'auto'. The registered levers: python -c \"from hf_accum.levers.base import registered; "
                "print([lever.name for lever in registered()])\"."
            )
        },
    )
    handle_preemption: bool = field(
        default=True,
        metadata={
            "help": (
                "On SIGTERM or a first Ctrl-C: finish the optimizer step in progress, save a checkpoint (with the "
                "plan), log how to resume and exit with code 143; every rank stops after the same step. A second "
                "Ctrl-C stops at once. False: the signals keep their usual effect."
            )
        },
    )
    max_nonfinite_steps: int | str | None = field(
        default="auto",
        metadata={
            "help": (
                "A window whose loss is NaN/inf on any rank is never stepped: its gradients are dropped (set to None, "
                "so AdamW does not move either) with a warning naming the step; the step counter and the LR "
                "scheduler still advance (the window's samples are consumed). More than this many such steps in a "
                "row: training stops with a checkpoint and an error. 0: stop at the first. None: no check (every step "
                "is taken, as transformers does). 'auto' (default): the engine's default, logged in one line: "
                f"{DEFAULT_MAX_NONFINITE_STEPS} where hf_accum takes the optimizer step (one process, DDP, FSDP); off "
                "under DeepSpeed, whose engine steps inside backward (non-finite losses are then DeepSpeed's to "
                "handle). A number set under DeepSpeed is refused."
            )
        },
    )
    grow_back_steps: int = field(default=16, metadata={"help": (
        "After an out-of-memory error lowered the plan mid-run, return to the plan in force before it (the probed, "
        "stored or given one) after this many optimizer steps without one; the wait doubles each time an OOM recurs. "
        "Every step stays exact on either plan. 0: keep the lowered plan for good.")})
    auto_eval_batch_size: bool | None = field(
        default=None,
        metadata={
            "help": (
                "At the first evaluation, set per_device_eval_batch_size to the largest batch of the longest eval "
                "example whose measured evaluation step fits the memory budget beside what training keeps (and "
                "eval_accumulation_steps so the predictions kept for compute_metrics fit too); stored with the plan "
                "and reused; every rank takes the smallest rank's. None: on when auto-tuning (auto_tune with a "
                "target_batch_size). False: as given (also under DeepSpeed, FSDP or TRL trainers on several ranks, "
                "whose evaluation forwards run collectives)."
            )
        },
    )

    def __post_init__(self):
        # Cheap, device-free checks first: a wrong value must fail before any distributed setup.
        self._resolve_checkpoint_layers()
        self._check_levers()
        if self.use_liger_kernel:  # now, not in transformers' ImportError after the probe (or Triton's on a CPU)
            liger.configure(self, "cpu" if self.use_cpu or not torch.cuda.is_available() else "cuda")
        for name in ("check_accumulation", "auto_tune", "probe_from_estimate"):
            require_bool(name, getattr(self, name))
        if not isinstance(self.loss_normalization, str) or self.loss_normalization not in NORMALIZATIONS:
            raise ValueError(
                f"loss_normalization={self.loss_normalization!r} is not one of {list(NORMALIZATIONS)}. "
                "Use 'tokens' for language modelling, 'samples' for one target per sample, 'model' to keep "
                "transformers' behaviour."
            )
        require_positive("per_device_train_batch_size", self.per_device_train_batch_size)
        require_positive("gradient_accumulation_steps", self.gradient_accumulation_steps)
        self._check_lengths()
        if self.target_batch_size is not None:
            require_positive("target_batch_size", self.target_batch_size)
        if self.check_accumulation_tolerance is not None and not (
            is_number(self.check_accumulation_tolerance) and self.check_accumulation_tolerance > 0
        ):
            raise ValueError(
                f"check_accumulation_tolerance={self.check_accumulation_tolerance!r} must be > 0 "
                "(e.g. 1e-4 for float32); leave it unset to choose it from the precision."
            )
        self._check_tuner_fields()
        if not isinstance(self.grow_back_steps, int) or isinstance(self.grow_back_steps, bool) or self.grow_back_steps < 0:
            raise ValueError(f"grow_back_steps={self.grow_back_steps!r} must be an integer >= 0 (0: never grow back).")
        self.max_nonfinite_steps = parse_nonfinite_limit(self.max_nonfinite_steps)
        if isinstance(self.max_steps, int) and (self.max_steps < -1 or self.max_steps == 0):
            # transformers trains num_train_epochs epochs for any max_steps <= 0, without a word
            raise ValueError(
                f"max_steps={self.max_steps} is not a number of steps: set a positive max_steps to stop after that "
                "many optimizer steps, or -1 (the default) to train num_train_epochs epochs."
            )
        self._check_schedule()
        check_intervals(self)
        if self.micro_batching not in ("samples", "tokens"):
            raise ValueError(f"micro_batching={self.micro_batching!r} must be 'samples' or 'tokens'.")
        if self.max_tokens_per_forward is not None:
            require_positive("max_tokens_per_forward", self.max_tokens_per_forward)
        if self.micro_batching == "tokens" and not self.tunes and self.max_tokens_per_forward is None:
            raise ValueError("micro_batching='tokens' needs a token budget: set target_batch_size (the probe measures "
                             "it) or, with auto_tune off, max_tokens_per_forward.")
        if self.auto_find_batch_size and self.target_batch_size is not None:
            raise ValueError(
                "auto_find_batch_size=True cannot be combined with target_batch_size: accelerate's back-off restarts "
                "the training loop from a fresh state with the already-updated weights (re-running samples) and "
                "halves the micro-batch while accumulation stays (the effective batch shrinks silently). hf_accum "
                "plans the batch and recovers from out-of-memory errors itself: set auto_find_batch_size=False."
            )
        if self.deepspeed:
            self._check_deepspeed_batch(world=None)  # the per-rank fields, before any distributed setup
        super().__post_init__()
        if self._flag_unset and isinstance(self.checkpoint_layers, int):
            # transformers resolved the unset flag to False; None again, so that a copy (dataclasses.replace) is not
            # read as an explicit False beside checkpoint_layers=k, which is refused
            for name in ("activation_checkpointing", "gradient_checkpointing"):
                if hasattr(self, name):
                    setattr(self, name, None)
        self._check_target_batch_size()
        if self.deepspeed:
            self._check_deepspeed_batch(world=self.world_size)

    def _check_schedule(self) -> None:
        """Values transformers accepts and then trains nothing with, or torch refuses after the model is built."""
        if self.max_steps == -1 and is_number(self.num_train_epochs) and self.num_train_epochs <= 0:
            raise ValueError(f"num_train_epochs={self.num_train_epochs} with max_steps=-1 trains nothing (0 optimizer "
                             "steps, an untrained model saved): set num_train_epochs > 0, or max_steps=N.")
        if not (is_number(self.learning_rate) and math.isfinite(self.learning_rate)) or self.learning_rate < 0:
            what = "is negative" if is_number(self.learning_rate) and self.learning_rate < 0 else \
                "is not a finite number"
            raise ValueError(f"learning_rate={self.learning_rate!r} {what}: set a positive learning_rate, e.g. 2e-4.")

    def _check_lengths(self) -> None:
        """The TRL configs' token limits (SFT's and DPO's max_length, GRPO's max_completion_length, ...): a negative
        one would slice `[:-3]`, dropping the last tokens of every example instead of failing."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _TOKEN_LIMITS and value is not None and (
                    not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{f.name}={value!r} must be a positive number of tokens (or None: no limit), e.g. "
                                 f"{f.name}=1024.")

    def _resolve_checkpoint_layers(self) -> None:
        """checkpoint_layers: "auto", an int k >= 0, or None (the boolean flag decides), from what the user set; read
        before `TrainingArguments.__post_init__` resolves an unset flag to False. A copy of resolved arguments
        (`dataclasses.replace`) resolves to the same setting: "auto" with the flag False stays "auto"."""
        flag = Settings(self).checkpointing_flag()
        setting = parse_layers(self.checkpoint_layers)
        if setting is None and flag is None:
            setting = "auto"
        if setting is not None and flag is True:
            raise ValueError(
                f"checkpoint_layers={setting!r} and gradient_checkpointing=True (every layer) contradict each other. "
                "Leave gradient_checkpointing unset (on the hf-accum command line: gradient_checkpointing=null) to have "
                "checkpoint_layers decide, or drop checkpoint_layers."
            )
        if isinstance(setting, int) and setting > 0 and flag is False:
            raise ValueError(
                f"checkpoint_layers={setting} and gradient_checkpointing=False (no layer) contradict each other. "
                "Leave gradient_checkpointing unset to checkpoint that many layers, or set checkpoint_layers=0."
            )
        self._flag_unset = flag is None
        self.checkpoint_layers = setting
        if flag is None and not _FLAG_DEFAULT_IS_NONE:
            self.gradient_checkpointing = False  # transformers < 5.23 reads it as a bool

    def _check_levers(self) -> None:
        """levers=...: known levers and values; checkpointing pinned there and by its own fields is refused."""
        from .levers.base import check_pins, parse_pins

        check_pins(self.levers)
        if "checkpointing" in parse_pins(self.levers) and (
                self.checkpoint_layers not in (None, "auto") or Settings(self).checkpointing_flag()):
            raise ValueError(f"levers={self.levers!r} pins checkpointing, and checkpoint_layers / gradient_checkpointing "
                             "set it too: give it in one place (drop it from levers, or unset the other).")

    @property
    def checkpointing_choice(self) -> str | int | bool:
        """What the user asked for: "auto" (the tuner chooses k), an int k, or True/False (every layer / none)."""
        if self.checkpoint_layers is not None:
            return self.checkpoint_layers
        return bool(Settings(self).checkpointing_flag())

    @property
    def tunes(self) -> bool:
        """Whether train() plans the micro-batch and accumulation itself."""
        return self.auto_tune and self.target_batch_size is not None

    def _check_tuner_fields(self) -> None:
        if not (is_number(self.memory_budget) and 0 < self.memory_budget <= 1):
            raise ValueError(
                f"memory_budget={self.memory_budget!r} must be a fraction in (0, 1] of the memory this process can "
                "use when training starts (e.g. 0.9); for an absolute budget set memory_budget_bytes."
            )
        if self.memory_budget_bytes is not None:
            require_positive("memory_budget_bytes", self.memory_budget_bytes)
        if self.probe_seq_len is not None:
            require_positive("probe_seq_len", self.probe_seq_len)
        if self.probe_max_micro_batch is not None:
            require_positive("probe_max_micro_batch", self.probe_max_micro_batch)
        if not isinstance(self.auto_tune_optimize, str) or self.auto_tune_optimize not in ("memory", "throughput"):
            raise ValueError(f"auto_tune_optimize={self.auto_tune_optimize!r} must be 'memory' or 'throughput'.")

    def _check_target_batch_size(self) -> None:
        world = self.world_size
        derived = Settings(self).given_batch()
        if self.target_batch_size is None or self.target_batch_size == derived:
            return
        if self.tunes:
            from .probing.plan import indivisible_target

            problem = indivisible_target(self.target_batch_size, world)
            if problem:
                raise ValueError(f"{problem}.")
            if self.gradient_accumulation_steps != field_default(self, "gradient_accumulation_steps"):
                # An accumulation states an effective batch of its own: two contradicting targets, refused. (A
                # micro-batch alone, or values that multiply to the target, are harmless: tune() warns they are
                # not used.)
                raise ValueError(
                    f"per_device_train_batch_size={self.per_device_train_batch_size} x gradient_accumulation_steps="
                    f"{self.gradient_accumulation_steps} x world size={world} = {derived} contradicts "
                    f"target_batch_size={self.target_batch_size}, and auto_tune plans both itself. Drop "
                    "per_device_train_batch_size and gradient_accumulation_steps (probe_max_micro_batch=N caps the "
                    "micro-batch), or set auto_tune=False with values that multiply to the target."
                )
            return
        fix = suggest_accumulation(self.target_batch_size, self.per_device_train_batch_size, world)
        raise ValueError(
            "auto_tune is off, so "
            f"target_batch_size={self.target_batch_size} but per_device_train_batch_size="
            f"{self.per_device_train_batch_size} x gradient_accumulation_steps={self.gradient_accumulation_steps}"
            f" x world size={world} = {derived}. {fix}"
        )

    def _check_deepspeed_batch(self, world: int | None) -> None:
        """Explicit DeepSpeed batch fields must equal the plan in force ("tokens" mode loads each rank's window whole:
        micro = the per-rank window, accumulation 1); refused here, before a model is loaded."""
        from .compat import deepspeed_integration
        from .integrations.engines.deepspeed_batch import batch_contradiction, zero_stage
        from .probing.plan import Plan

        if self.tunes:
            self._check_deepspeed_tuned_fields()
            return
        micro, accumulation = self.per_device_train_batch_size, self.gradient_accumulation_steps
        if self.micro_batching == "tokens":
            micro, accumulation = micro * accumulation, 1
        config = deepspeed_integration.deepspeed_user_config(self.deepspeed)
        engine = deepspeed_integration.engine_name(zero_stage(config))
        plan = (f"micro {micro} × accumulation {accumulation} per rank on {engine}" if world is None else
                Plan(micro, accumulation, world, micro * accumulation * world, engine=engine).describe())
        problem = batch_contradiction(config, micro, accumulation, world, plan)
        if problem:
            raise ValueError(problem)

    def _check_deepspeed_tuned_fields(self) -> None:
        """auto_tune chooses the micro-batch and accumulation, so the config may not fix them; its total batch, if
        given, must be the target."""
        from .compat import deepspeed_integration

        config = deepspeed_integration.deepspeed_user_config(self.deepspeed)
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            if config.get(key, "auto") != "auto":
                raise ValueError(
                    f"deepspeed config {key}={config[key]!r} fixes what auto_tune chooses (the probe measures "
                    f'through the DeepSpeed engine and plans it). Set "{key}": "auto", or auto_tune=False.'
                )
        given = config.get("train_batch_size", "auto")
        if given != "auto" and given != self.target_batch_size:
            raise ValueError(
                f"deepspeed config train_batch_size={given!r} contradicts target_batch_size={self.target_batch_size}. "
                f'Set "train_batch_size": "auto" (hf_accum fills it from the plan) or {self.target_batch_size}.'
            )

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step over all ranks, as configured now."""
        return Settings(self).given_batch()
