"""GRPO (hf_accum/integrations/trl/grpo.py): `AccumGRPOTrainer` and a user's `class MyGRPO(AccumulationMixin, trl.GRPOTrainer)`.

The exactness tests fix generation (TRL's sampler replaced by a deterministic function of the prompt, so the same
completions reach every trainer), run one optimizer step with uneven cuts and an out-of-memory error injected
mid-window, and compare the gradient with one pass over the whole generation batch whose loss is written out by hand
in float64 (`reference_grad`: never through TRL's or hf_accum's loss code), and with GRPOTrainer's own step where
TRL's cut is equal."""

import copy
import logging

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

from hf_accum import tiny  # noqa: E402
from hf_accum.trainer import AccumulationMixin  # noqa: E402
from hf_accum.trl import AccumGRPOConfig, AccumGRPOTrainer  # noqa: E402
from tests.exactness import StepRecorder, load_weights, recording, relative_error  # noqa: E402

MAX_COMPLETION = 9
GENERATIONS = 4
COMMON = dict(max_steps=1, learning_rate=1e-2, max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no",
              use_cpu=True, bf16=False, seed=0, disable_tqdm=True, num_generations=GENERATIONS,
              max_completion_length=MAX_COMPLETION, gradient_checkpointing=False, epsilon=0.2)


def fixed_completions(trainer):
    """TRL's sampling replaced: completion ``j`` of each prompt is a function of the prompt's tokens and ``j``, of
    1..MAX_COMPLETION tokens, some ended by EOS (as sampled completions are), so the masks differ row to row."""
    eos, seen = trainer.processing_class.eos_token_id, {}

    def generate(prompt_ids, images, multimodal_fields, num_generations):
        out = []
        for ids in prompt_ids:
            key = tuple(ids)
            j = seen[key] = seen.get(key, -1) + 1
            length = 1 + (sum(ids) * 7 + j * 5) % MAX_COMPLETION
            tokens = [10 + (sum(ids) + 3 * j + 11 * t) % 60 for t in range(length)]
            if (sum(ids) + j) % 3 == 0 and length < MAX_COMPLETION:
                tokens.append(eos)
            out.append(tokens)
        return out, None

    trainer._generate_single_turn = generate


class _Float64LogProbs:
    """TRL's fused LM head kernel (`trl.kernels.ChunkedLogProbFunction`) returns float32 log-probabilities whatever the
    model's dtype (~1e-7 relative); these tests check the accumulation at 1e-10, so the kernel is replaced by the same
    quantities from a plain log-softmax in the model's dtype (the loss code around it stays TRL's)."""

    @staticmethod
    def apply(hidden, weight, bias, labels, temperature, chunk_size, softcapping, logit_scale, outputs):
        assert softcapping is None
        logits = torch.nn.functional.linear(hidden, weight, bias) * logit_scale / temperature
        logp = torch.log_softmax(logits, -1)
        picked = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        return picked, entropy, None, None, None


@pytest.fixture(autouse=True)
def float64_fused_head(monkeypatch):
    import trl.trainer.utils

    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", _Float64LogProbs)


def reward_digits(completions, **kwargs):
    return [float(sum(c.isdigit() for c in text)) for text in completions]


def reward_length(completions, **kwargs):
    return [len(text) / 10.0 for text in completions]


def prompts(n: int) -> Dataset:
    return Dataset.from_list([{"prompt": r["prompt"] + "\n"} for r in tiny.generate_instruction_data(n, seed=3)])


def lora_config():
    """A LoRA adapter that is not a no-op at its start (B random too), so the policy differs from TRL's reference,
    the base model (adapters disabled), and the KL term has a gradient at the first step."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)


def grpo_run(tmp_path, cls, config_cls, micro, accumulation, *, lora=False, oom_calls=(), **config):
    """One optimizer step on micro x accumulation completions (groups of 4); returns the trainer (its generated
    windows recorded), the recorder, the model as it was before the step and the rows of every training forward."""
    tok = tiny.build_tokenizer()
    model = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    initial = copy.deepcopy(model)
    torch.manual_seed(0)  # the adapter's initial weights
    args = config_cls(output_dir=str(tmp_path), per_device_train_batch_size=micro,
                      gradient_accumulation_steps=accumulation, **{**COMMON, **config})
    recorder = StepRecorder()
    generated_windows = issubclass(cls, AccumulationMixin) and config.get("loss_normalization") != "model"
    cls = recording(cls) if generated_windows else cls  # TRL loads prompts: nothing to record before generating
    trainer = cls(model=model, args=args, train_dataset=prompts(16), processing_class=tok,
                  reward_funcs=[reward_digits, reward_length], callbacks=[recorder],
                  peft_config=lora_config() if lora else None)
    model = trainer.model
    trainer.remove_callback(PrinterCallback)
    fixed_completions(trainer)
    seen, widths = [], []
    trainer.widths = widths  # tokens per row of each training forward

    def training_forward(module, args, kwargs):  # the forwards with gradients (not the reference's, under no_grad)
        if torch.is_grad_enabled():
            seen.append(kwargs["input_ids"].shape[0])
            widths.append(kwargs["input_ids"].shape[1])
            if len(seen) in oom_calls:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")

    model.register_forward_pre_hook(training_forward, with_kwargs=True)
    trainer.train()
    return trainer, recorder, initial, seen


# --- the independent reference: one pass over the whole generation batch, the loss by hand --------------------
def merged(window: list[dict]) -> dict:
    return {k: torch.cat([b[k] for b in window]) for k in window[0] if window[0][k].dim() > 0}


def advantages_by_hand(batch: dict, tok) -> torch.Tensor:
    """Each completion's reward (the two reward functions on its decoded text) minus its prompt group's mean, over
    the group's standard deviation (Bessel-corrected) + 1e-4."""
    rewards, groups = [], {}
    for row, (ids, mask) in enumerate(zip(batch["completion_ids"], batch["completion_mask"])):
        text = tok.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
        rewards.append(reward_digits([text])[0] + reward_length([text])[0])
        groups.setdefault(tuple(batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()), []).append(row)
    rewards = torch.tensor(rewards, dtype=torch.float64)
    out = torch.empty_like(rewards)
    for rows in groups.values():
        assert len(rows) == GENERATIONS
        r = rewards[rows]
        out[rows] = (r - r.mean()) / (r.std(unbiased=True) + 1e-4)
    return out


def completion_logps(model, batch: dict, entropies: bool = False):
    """log p(completion token t | prompt, completion tokens before t), from the full logits, float64 (and, with
    ``entropies``, the entropy of each of those distributions)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].shape[1]
    logits = model(input_ids=ids, attention_mask=attention).logits[:, -width - 1:-1]
    logp = torch.log_softmax(logits, -1)
    picked = logp.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    return (picked, -(logp.exp() * logp).sum(-1)) if entropies else picked


def reference_grad(initial, weights: dict, window: list[dict], loss_type: str, beta: float, sequence_level: bool,
                   tok, generating: dict | None = None, entropy_coef: float = 0.0,
                   max_completion: int = MAX_COMPLETION, top_entropy_quantile: float = 1.0) -> dict:
    """The gradient of the step's GRPO loss over the whole generation batch, written out by hand: the clipped
    surrogate (importance ratio exp(logp - logp.detach()) per token, or of its masked mean per completion at sequence
    level), plus beta x the k3 KL estimate to the reference times the ratio (the base model: adapters disabled), normalized as
    ``loss_type`` defines it over the whole batch. ``generating``: the weights that generated the batch when they
    are not ``weights`` (num_iterations > 1), whose log-probabilities the ratio is then taken against.
    ``entropy_coef``: minus that times the token mean over the whole batch of each completion token's entropy (TRL's
    static entropy bonus). ``top_entropy_quantile`` < 1: the surrogate (and the bonus) only on the completion tokens
    whose entropy is at least the (1 - quantile) quantile of all the batch's completion tokens' entropies (taken in
    float32, as TRL does)."""
    batch = merged(window)
    model = copy.deepcopy(initial)
    if any(name.startswith("base_model.") for name in weights):  # trained as a LoRA adapter
        from peft import get_peft_model

        model = get_peft_model(model, lora_config())
    load_weights(model, weights)
    model.train()
    model.zero_grad(set_to_none=True)
    mask = batch["completion_mask"].double()
    # TRL computes rewards and advantages in float32: the batch's values are the ones trained on, checked here
    advantages = batch["advantages"].double()
    assert torch.allclose(advantages_by_hand(batch, tok), advantages, rtol=0, atol=1e-5)
    logps, entropy = completion_logps(model, batch, entropies=True)
    old = logps.detach()
    if generating is not None:
        policy = copy.deepcopy(model)
        load_weights(policy, generating)
        with torch.no_grad():
            old = completion_logps(policy, batch)
    log_ratio = logps - old
    if sequence_level:
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_ratio)
    a = advantages.unsqueeze(1)
    per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - 0.2, 1 + 0.2) * a)
    bonus = mask
    if top_entropy_quantile < 1.0:
        threshold = torch.quantile(entropy.detach()[mask.bool()].float(), 1 - top_entropy_quantile)
        high = ((entropy.detach() * mask >= threshold) & mask.bool()).double()
        assert 0 < high.sum() < mask.sum()
        per_token, bonus = per_token * high, mask * high
    if beta:
        with torch.no_grad(), model.disable_adapter():
            ref = completion_logps(model, batch)
        delta = ref - logps
        # GRPOConfig's use_bias_correction_kl (default True): the estimate weighted by the importance ratio
        per_token = per_token + beta * (torch.exp(delta) - delta - 1) * ratio
    per_token = per_token * mask
    rows = mask.shape[0]
    loss = {"dapo": per_token.sum() / mask.sum(),
            "grpo": (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).mean(),
            "dr_grpo": per_token.sum() / (rows * max_completion),
            "luspo": per_token.sum(-1).mean()}[loss_type]
    loss = loss - entropy_coef * (entropy * bonus).sum() / bonus.sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


CASES = [(loss, beta) for loss in ("dapo", "grpo", "dr_grpo", "luspo") for beta in (0.0, 0.05)]


@pytest.mark.parametrize(("loss_type", "beta"), CASES, ids=[f"{lt}-beta{b}" for lt, b in CASES])
def test_one_step_with_uneven_cuts_and_an_oom_equals_one_pass_and_trls_equal_cut(tmp_path, caplog, loss_type, beta):
    """20 completions (5 prompts x 4) as 4 slices of 5; the 2nd training forward runs out of memory, so the window is
    re-run in forwards of 3 + 2 completions. beta > 0 on a LoRA model (TRL's reference: adapters disabled)."""
    tok = tiny.build_tokenizer()
    level = "sequence" if loss_type == "luspo" else "token"
    config = dict(loss_type=loss_type, beta=beta, importance_sampling_level=level, lora=beta > 0)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        ours, recorder, initial, seen = grpo_run(tmp_path / "ours", AccumGRPOTrainer, AccumGRPOConfig, 5, 4,
                                                 oom_calls=(2,), auto_tune=False, target_batch_size=20, **config)
    assert "out of memory at step 0" in caplog.text
    assert seen[:2] == [5, 5] and sorted(set(seen[2:])) == [2, 3] and sum(seen[2:]) == 20  # uneven, whole rows
    assert [sum(len(b["advantages"]) for b in w) for w in ours.windows] == [20]
    # each forward ends at its own longest completion (the window's widest is prompt + max_completion_length)
    full = max(b["prompt_ids"].shape[1] + b["completion_ids"].shape[1] for b in ours.windows[0])
    assert max(ours.widths) <= full and min(ours.widths[2:]) < full
    assert ours._normalization == ("tokens" if loss_type == "dapo" else "samples")
    want = reference_grad(initial, recorder.weights[0], ours.windows[0], loss_type, beta, level == "sequence", tok)
    assert relative_error(recorder.grads[0], want) <= 1e-10

    theirs, trl_recorder, _, trl_seen = grpo_run(tmp_path / "trl", trl.GRPOTrainer, trl.GRPOConfig, 5, 4,
                                                 **config)
    assert trl_seen == [5, 5, 5, 5]
    assert relative_error(trl_recorder.grads[0], recorder.grads[0]) <= 1e-10


def test_num_iterations_trains_each_generation_batch_that_many_steps_exactly(tmp_path):
    """num_iterations=2: steps 1 and 2 train on one generation batch (step 2 against the log-probabilities of the
    policy that generated it, its importance ratios no longer 1), step 3 generates anew. Each step is one window of
    the whole generation batch, exact through uneven cuts after an OOM in step 2, and equal to GRPOTrainer's own."""
    tok = tiny.build_tokenizer()
    config = dict(loss_type="grpo", beta=0.05, lora=True, num_iterations=2, max_steps=3)
    ours, recorder, initial, seen = grpo_run(tmp_path / "ours", AccumGRPOTrainer, AccumGRPOConfig, 5, 4,
                                             oom_calls=(6,), auto_tune=False, target_batch_size=20, **config)
    assert len(ours.windows) == 3 and [sum(len(b["advantages"]) for b in w) for w in ours.windows] == [20] * 3
    first, again, fresh = (merged(w) for w in ours.windows)
    assert all(torch.equal(first[k], again[k]) for k in first)  # the same completions, advantages, old log-probs
    assert "old_per_token_logps" in first and not torch.equal(first["prompt_ids"], fresh["prompt_ids"])
    # step 2's 2nd forward ran out of memory: its window re-run (and step 3's) in forwards of at most 3 rows
    assert seen[:6] == [5] * 6 and max(seen[6:]) <= 3 and sum(seen[6:]) == 40
    generating = [recorder.weights[0], recorder.weights[0], recorder.weights[2]]
    for step in range(3):
        want = reference_grad(initial, recorder.weights[step], ours.windows[step], "grpo", 0.05, False, tok,
                              generating=generating[step])
        assert relative_error(recorder.grads[step], want) <= 1e-10, step
    # the ratios of step 2 are not all 1: the reference without the generating policy's log-probs differs
    stale = reference_grad(initial, recorder.weights[1], ours.windows[1], "grpo", 0.05, False, tok)
    assert relative_error(recorder.grads[1], stale) > 1e-6

    _, trl_recorder, _, trl_seen = grpo_run(tmp_path / "trl", trl.GRPOTrainer, trl.GRPOConfig, 5, 4, **config)
    assert trl_seen == [5] * 12
    for step in range(3):
        assert relative_error(trl_recorder.grads[step], recorder.grads[step]) <= 1e-10, step


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_the_static_entropy_bonus_is_a_token_mean_over_the_generation_batch(tmp_path, loss_type):
    """entropy_coef > 0 (TRL's static entropy bonus: coef x the token mean of the completion tokens' entropies):
    through uneven cuts and an OOM, the bonus is the token mean over the whole generation batch (its count the
    window's tokens, also under grpo's per-completion normalization), as in GRPOTrainer's step over one micro-batch
    of the whole batch; TRL's 4 micro-batches average 4 token means instead."""
    tok = tiny.build_tokenizer()
    config = dict(loss_type=loss_type, entropy_coef=0.1, max_steps=1)
    ours, recorder, initial, seen = grpo_run(tmp_path / "ours", AccumGRPOTrainer, AccumGRPOConfig, 5, 4,
                                             oom_calls=(2,), auto_tune=False, target_batch_size=20, **config)
    assert seen[:2] == [5, 5] and sorted(set(seen[2:])) == [2, 3]
    want = reference_grad(initial, recorder.weights[0], ours.windows[0], loss_type, 0.0, False, tok, entropy_coef=0.1)
    assert relative_error(recorder.grads[0], want) <= 1e-10
    without = reference_grad(initial, recorder.weights[0], ours.windows[0], loss_type, 0.0, False, tok)
    assert relative_error(recorder.grads[0], without) > 1e-4  # the bonus moves the gradient
    assert ours.state.log_history[0]["entropy_coef"] == pytest.approx(0.1, rel=1e-12)  # the user's, not scaled

    _, whole, _, _ = grpo_run(tmp_path / "trl", trl.GRPOTrainer, trl.GRPOConfig, 20, 1, **config)
    assert relative_error(whole.grads[0], recorder.grads[0]) <= 1e-10


@pytest.mark.parametrize(("loss_type", "entropy_coef"), [("dapo", 0.0), ("grpo", 0.1)])
def test_the_entropy_filter_takes_its_quantile_over_the_generation_batch(tmp_path, loss_type, entropy_coef):
    """top_entropy_quantile=0.2 (TRL trains on the 20% highest-entropy completion tokens of each forward): hf_accum's
    quantile is over the whole generation batch, so through uneven cuts and an OOM the step equals one pass over
    the batch with the filter written by hand, and GRPOTrainer's step over one micro-batch of the whole batch (with
    the static entropy bonus over the same tokens, for grpo); TRL's 4 micro-batches take 4 quantiles instead."""
    tok = tiny.build_tokenizer()
    config = dict(loss_type=loss_type, top_entropy_quantile=0.2, entropy_coef=entropy_coef)
    ours, recorder, initial, seen = grpo_run(tmp_path / "ours", AccumGRPOTrainer, AccumGRPOConfig, 5, 4,
                                             oom_calls=(2,), auto_tune=False, target_batch_size=20, **config)
    assert seen[:2] == [5, 5] and sorted(set(seen[2:])) == [2, 3]
    window = ours.windows[0]
    want = reference_grad(initial, recorder.weights[0], window, loss_type, 0.0, False, tok,
                          entropy_coef=entropy_coef, top_entropy_quantile=0.2)
    assert relative_error(recorder.grads[0], want) <= 1e-10
    unfiltered = reference_grad(initial, recorder.weights[0], window, loss_type, 0.0, False, tok,
                                entropy_coef=entropy_coef)
    assert relative_error(recorder.grads[0], unfiltered) > 1e-3

    _, whole, _, _ = grpo_run(tmp_path / "whole", trl.GRPOTrainer, trl.GRPOConfig, 20, 1, **config)
    assert relative_error(whole.grads[0], recorder.grads[0]) <= 1e-10
    _, four, _, _ = grpo_run(tmp_path / "four", trl.GRPOTrainer, trl.GRPOConfig, 5, 4, **config)
    assert relative_error(four.grads[0], recorder.grads[0]) > 1e-3  # TRL's per-forward quantiles: cut-dependent


# --- micro_batching="tokens": forwards cut by the completions' real lengths -------------------------------------
LONG = 64  # max_completion_length; the sampled completions have at most MAX_COMPLETION (9) tokens + EOS
LONGEST_PROMPT = 22  # tokens of prompts(16)'s longest prompt
BUDGET = 5 * (LONGEST_PROMPT + LONG)  # 5 rows at the worst case: "samples" mode's rows per forward at this memory


def forwards_under_budget(trainer, seen):
    """(rows, width) of each training forward, checked against the budget: each forward holds whole completions
    and ends at its own longest one (never at LONG)."""
    forwards = list(zip(seen, trainer.widths))
    assert all(rows * width <= BUDGET for rows, width in forwards), forwards
    assert max(width for _, width in forwards) <= LONGEST_PROMPT + MAX_COMPLETION + 1
    return forwards


TOKEN_CASES = [("dapo", 0.0), ("grpo", 0.05), ("dr_grpo", 0.0), ("luspo", 0.0)]


@pytest.mark.parametrize(("loss_type", "beta"), TOKEN_CASES, ids=[f"{lt}-beta{b}" for lt, b in TOKEN_CASES])
def test_a_token_budget_cuts_by_the_real_completion_lengths_exactly(tmp_path, caplog, loss_type, beta):
    """micro_batching="tokens", 430 tokens per forward (5 rows of prompt + max_completion_length=64): the sampled
    completions are 1-10 tokens, so the window of 20 completions is cut by their real lengths into forwards of
    uneven row counts; the 1st forward runs out of memory and the window is re-cut under a smaller budget. The step
    equals one pass over the generation batch, the loss by hand, for every loss type (the count is the window's)."""
    tok = tiny.build_tokenizer()
    level = "sequence" if loss_type == "luspo" else "token"
    config = dict(loss_type=loss_type, beta=beta, importance_sampling_level=level, lora=beta > 0,
                  max_completion_length=LONG)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        ours, recorder, initial, seen = grpo_run(tmp_path, AccumGRPOTrainer, AccumGRPOConfig, 5, 4, oom_calls=(1,),
                                                 auto_tune=False, target_batch_size=20, micro_batching="tokens",
                                                 max_tokens_per_forward=BUDGET, **config)
    assert "out of memory at step 0" in caplog.text
    assert ours.args.gradient_accumulation_steps == 1 and ours.args.per_device_train_batch_size == 20
    forwards = forwards_under_budget(ours, seen)
    after = forwards[1:]  # the re-run window, whole completions
    assert sum(rows for rows, _ in after) == 20 and len({rows for rows, _ in after}) > 1  # uneven cuts
    assert [sum(len(b["advantages"]) for b in w) for w in ours.windows] == [20]
    want = reference_grad(initial, recorder.weights[0], ours.windows[0], loss_type, beta, level == "sequence", tok,
                          max_completion=LONG)
    assert relative_error(recorder.grads[0], want) <= 1e-10


def test_a_token_budget_runs_fewer_forwards_than_samples_mode_on_short_completions(tmp_path):
    """At the memory of 5 worst-case rows per forward ("samples" mode: 4 forwards of 5 for 20 completions), the
    short completions' real lengths fit 20 rows in fewer forwards; the generation and its no-gradient forwards run
    in chunks of the 5 rows the budget holds at the worst case."""
    chunks = []

    class Trainer(AccumGRPOTrainer):
        def train(self, *args, **kwargs):
            sample = self._generate_single_turn

            def generate(prompt_ids, *rest):
                chunks.append(len(prompt_ids))
                return sample(prompt_ids, *rest)

            self._generate_single_turn = generate
            return super().train(*args, **kwargs)

    tokens, _, _, token_seen = grpo_run(tmp_path / "tokens", Trainer, AccumGRPOConfig, 5, 4, auto_tune=False,
                                        target_batch_size=20, micro_batching="tokens", max_tokens_per_forward=BUDGET,
                                        loss_type="grpo", max_completion_length=LONG)
    samples, _, _, sample_seen = grpo_run(tmp_path / "samples", AccumGRPOTrainer, AccumGRPOConfig, 5, 4,
                                          auto_tune=False, target_batch_size=20, loss_type="grpo",
                                          max_completion_length=LONG)
    assert sample_seen == [5, 5, 5, 5]
    forwards = forwards_under_budget(tokens, token_seen)
    assert sum(rows for rows, _ in forwards) == 20 and len(forwards) < len(sample_seen)
    assert chunks and max(chunks) <= 5  # BUDGET // (longest prompt + LONG) prompts per generation chunk


def test_auto_tune_with_a_token_budget_probes_grpo_batches_at_shorter_completions(tmp_path, monkeypatch):
    """micro_batching="tokens" with auto_tune: the probe measures GRPO's training step at the worst case (longest
    prompt + max_completion_length) and, for the budget's short end, at shorter completions after the same prompt
    (not the prompts collated as training examples); the plan loads the whole generation batch (accumulation 1).
    The training set's prompts are tokenized once for all the probes."""
    from hf_accum.compat import trl_internals

    tokenized = []
    lengths = trl_internals.grpo_prompt_lengths
    monkeypatch.setattr(trl_internals, "grpo_prompt_lengths", lambda t, p: tokenized.append(len(p)) or lengths(t, p))
    trainer, _, _, seen = grpo_run(tmp_path, AccumGRPOTrainer, AccumGRPOConfig, 8, 1, target_batch_size=20,
                                   micro_batching="tokens", probe_max_micro_batch=5, loss_type="grpo",
                                   max_completion_length=LONG)
    plan = trainer.plan
    assert plan.token_budget is not None and (plan.micro_batch_size, plan.gradient_accumulation_steps) == (20, 1)
    probed = set(trainer.widths[:-1])  # the last forward is the training step's
    assert max(probed) == LONGEST_PROMPT + LONG and min(probed) < LONGEST_PROMPT + LONG
    assert min(probed) > LONGEST_PROMPT  # a prompt and at least one completion token
    assert sum(seen[-1:]) == 20 and trainer.widths[-1] <= LONGEST_PROMPT + MAX_COMPLETION + 1
    assert tokenized.count(len(trainer.train_dataset)) == 1


# --- refusals: before the first optimizer step, one line naming the fix ----------------------------------------
def test_bnpo_is_refused_when_the_config_is_built_naming_dapo():
    with pytest.raises(ValueError, match=r"^loss_type='bnpo' divides each forward's token sum by that forward's own "
                                         r"tokens.*Use loss_type='dapo'"):
        AccumGRPOConfig(output_dir="unused", loss_type="bnpo")


@pytest.mark.parametrize(("config", "words"), [
    (dict(steps_per_generation=4), r"steps_per_generation=4 differs from gradient_accumulation_steps=2"),
    (dict(use_adaptive_entropy=True), r"use_adaptive_entropy=True changes entropy_coef"),
    (dict(loss_normalization="tokens", loss_type="grpo"), r"loss_normalization='tokens' does not fit loss_type='grpo'"),
])
def test_what_cannot_be_exact_is_refused_by_the_config(config, words):
    with pytest.raises(ValueError, match=words):
        AccumGRPOConfig(output_dir="unused", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                        num_generations=2, use_cpu=True, **config)


def test_the_target_counts_whole_groups_of_completions():
    with pytest.raises(ValueError, match=r"target_batch_size=6 completions is not a multiple of num_generations=4"):
        AccumGRPOConfig(output_dir="unused", per_device_train_batch_size=3, gradient_accumulation_steps=2,
                        num_generations=4, use_cpu=True, target_batch_size=6, auto_tune=False)


def test_model_normalization_is_trls_own_accumulation(tmp_path):
    # loss_normalization='model': GRPOTrainer untouched (bnpo allowed); the step equals TRL's
    ours, recorder, _, seen = grpo_run(tmp_path / "ours", AccumGRPOTrainer, AccumGRPOConfig, 4, 2, loss_type="bnpo",
                                       loss_normalization="model", auto_tune=False)
    theirs, trl_recorder, _, trl_seen = grpo_run(tmp_path / "trl", trl.GRPOTrainer, trl.GRPOConfig, 4, 2,
                                                 loss_type="bnpo")
    assert seen == trl_seen == [4, 4]
    assert relative_error(trl_recorder.grads[0], recorder.grads[0]) <= 1e-12


def test_auto_tune_plans_rows_per_forward_from_the_training_step_at_the_longest_prompt(tmp_path, caplog):
    """A target of 16 completions and a small memory budget: the probe measures TRL's training step on batches at the
    longest prompt + max_completion_length, plans micro x accumulation = 16; each rank loads the whole generation
    batch (one window) and the forwards hold at most the planned rows."""
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer, recorder, initial, seen = grpo_run(tmp_path, AccumGRPOTrainer, AccumGRPOConfig, 8, 1,
                                                    target_batch_size=16, probe_max_micro_batch=5)
    plan = trainer.plan
    assert plan.micro_batch_size * plan.gradient_accumulation_steps == 16 and plan.micro_batch_size <= 5
    assert trainer.args.steps_per_generation == 1 and trainer.args.generation_batch_size == 16
    assert [sum(len(b["advantages"]) for b in w) for w in trainer.windows] == [16]  # one window: the whole batch
    training = seen[-plan.gradient_accumulation_steps:]
    assert training == [plan.micro_batch_size] * plan.gradient_accumulation_steps
    assert 5 in seen[:-len(training)]  # the probe measured the training step up to the cap
    assert f"hf_accum plan: micro {plan.micro_batch_size} × accumulation {plan.gradient_accumulation_steps}" in caplog.text


def test_generation_runs_in_chunks_of_the_planned_rows_and_an_oom_there_re_runs_that_chunk_smaller(tmp_path, caplog):
    """Generation (the patched sampler standing for transformers' generate) runs over at most the rows of one forward
    at a time; an out-of-memory error in it re-generates that chunk in halves, the next generation batch starts from
    the smaller size, and the optimizer step still sees the whole generation batch, exactly."""
    calls = []

    class Trainer(AccumGRPOTrainer):
        def train(self, *args, **kwargs):
            sample = self._generate_single_turn  # fixed_completions' sampler, set by grpo_run

            def generate(prompt_ids, *rest):
                calls.append(len(prompt_ids))
                if len(calls) == 2:  # the second chunk of the first generation batch
                    raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
                return sample(prompt_ids, *rest)

            self._generate_single_turn = generate
            return super().train(*args, **kwargs)

    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer, recorder, initial, _ = grpo_run(tmp_path, Trainer, AccumGRPOConfig, 5, 4, auto_tune=False,
                                                 target_batch_size=20, loss_type="grpo", max_steps=2)
    assert "out of memory in generation; generating 2 prompts at a time" in caplog.text
    # per_device 5 x accumulation 4: 20 prompt rows per generation batch, at most 5 per call, then 2
    # 20 prompt rows per generation batch, 5 per call (the rows of one forward); the 2nd call fails: the 15 rows left
    # go 2 at a time, and so does the next generation batch
    assert calls == [5, 5] + [2] * 7 + [1] + [2] * 10
    assert [sum(len(b["advantages"]) for b in w) for w in trainer.windows] == [20, 20]
    want = reference_grad(initial, recorder.weights[0], trainer.windows[0], "grpo", 0.0, False, tiny.build_tokenizer())
    assert relative_error(recorder.grads[0], want) <= 1e-10


def sampled_run(tmp_path, cls, config_cls, **config):
    """Five optimizer steps with TRL's own sampling (temperature 1): the completions of every generation call and
    the logged losses."""
    tok = tiny.build_tokenizer()
    model = tiny.build_model("causal_lm", tokenizer=tok, hidden_size=32)
    args = config_cls(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=4,
                      **{**COMMON, "max_steps": 5, "learning_rate": 0.05, **config})
    trainer = cls(model=model, args=args, train_dataset=prompts(40), processing_class=tok,
                  reward_funcs=[reward_digits, reward_length])
    trainer.remove_callback(PrinterCallback)
    calls, sample = [], trainer._generate_single_turn

    def generate(prompt_ids, *rest, **kwargs):
        out = sample(prompt_ids, *rest, **kwargs)
        calls.append(out[0])
        return out

    trainer._generate_single_turn = generate
    trainer.train()
    return calls, [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_with_no_target_grpo_makes_trls_one_generation_call_and_its_steps(tmp_path, loss_type):
    """Still a GRPOTrainer: with no target, one generation call per generation batch as TRL makes it (chunks would
    change the sampling stream), so five steps sample TRL's completions and log its losses, bit for bit: grpo's (TRL
    divides each micro-batch's mean by the accumulation, hf_accum multiplies it by its share, 1/4: the same float
    operation) and dapo's (each forward is handed the window's token count, as TRL hands it: `GRPOAdapter.share`)."""
    theirs = sampled_run(tmp_path / "trl", trl.GRPOTrainer, trl.GRPOConfig, loss_type=loss_type)
    ours = sampled_run(tmp_path / "ours", AccumGRPOTrainer, AccumGRPOConfig, loss_type=loss_type)
    assert [len(c) for c in theirs[0]] == [16] * 5
    assert ours[0] == theirs[0]
    assert len(ours[1]) == 5 and ours[1] == theirs[1]
