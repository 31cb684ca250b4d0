"""Preference pairs on paper (issue 41 item 3): TRL's DPO and reward steps on fake tensors, against the trainers' own
probes (real training steps through `compute_loss`) on the same settings, on CPU. Checkpointing is off on both sides
(the lora_dpo recipe pins it on; checkpointing on paper is a separate lever)."""

import pytest

pytest.importorskip("trl")

pytestmark = pytest.mark.xdist_group("recipe_probe")  # the session's lora_dpo probe (`recipe_probe`), probed once

from hf_accum import tiny  # noqa: E402
from hf_accum.probing.estimate import estimate_model  # noqa: E402

MiB = 2**20
DPO_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"]


def _measured(result):
    return {t.micro_batch_size: t.peak_bytes for t in result.measured_trials if t.peak_bytes}


def _tiny_config(num_labels=2):
    return tiny.build_model(tokenizer=tiny.build_tokenizer(), num_labels=num_labels).config


def _dpo_build(lora=True):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = _tiny_config()

    def build():
        model = AutoModelForCausalLM.from_config(config)
        if not lora:
            return model
        return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                target_modules=DPO_TARGETS))

    return build


@pytest.fixture(scope="module")
def dpo_probe(recipe_probe):
    """The lora_dpo recipe's own probe (its trainer, data, collator, LoRA and 64 MiB budget), checkpointing off: the
    session's one (tests/recipes/test_estimate_recipes.py compares the recipe's estimate with it too)."""
    return recipe_probe("lora_dpo", "gradient_checkpointing=false").result


def test_the_lora_dpo_recipe_is_within_5_percent_of_its_probe(dpo_probe):
    measured = _measured(dpo_probe)
    seq_len = dpo_probe.extra["seq_len"]  # the probe's batch: the longest pair, both rows padded to it
    est = estimate_model(_dpo_build(), seq_len=seq_len, target_batch_size=16, device="cpu", device_memory=64 * 2**30,
                         budget_bytes=64 * MiB, pairs="dpo", also=tuple(measured), all_peaks=False)
    assert len(measured) >= 2
    for micro, peak in measured.items():
        print(f"lora_dpo micro {micro}: measured {peak / MiB:.2f} MiB, estimated {est.peaks[micro] / MiB:.2f} MiB "
              f"({est.peaks[micro] / peak - 1:+.2%})")
        assert abs(est.peaks[micro] / peak - 1) <= 0.05, (micro, peak, est.peaks[micro])
    assert abs(est.result.max_micro_batch_size - dpo_probe.max_micro_batch_size) <= 1
    assert "adapters disabled" in est.loss


@pytest.fixture(scope="module")
def precomputed_dpo():
    """The LoRA DPO estimate at 32 tokens with the reference log-probs precomputed, peaks at 1, 2 and 4 pairs: read by
    the two tests below (a size's peak is its own step's, whatever else the search ran)."""
    return estimate_model(_dpo_build(), seq_len=32, target_batch_size=4, device="cpu", device_memory=64 * 2**30,
                          budget_bytes=512 * MiB, pairs="dpo", also=(1, 2, 4), precompute_ref_log_probs=True,
                          all_peaks=False)


def test_a_micro_batch_of_pairs_is_twice_the_rows(precomputed_dpo):
    """m pairs forward 2m rows: the DPO estimate at m pairs is the plain causal-LM step's at 2m rows and more (the
    reference forward, the fused head's per-token outputs), never the step's at m rows."""
    kwargs = dict(seq_len=32, target_batch_size=2, device="cpu", device_memory=64 * 2**30, budget_bytes=512 * MiB)
    pairs = precomputed_dpo.peaks
    rows = estimate_model(_dpo_build(), also=(1, 2, 4), all_peaks=False, **kwargs).peaks
    assert pairs[1] > rows[1] and pairs[2] > rows[2]
    assert pairs[2] - pairs[1] > 1.5 * (rows[2] - rows[1])  # one more pair is about two more rows


def test_precomputed_reference_log_probs_replace_the_reference_forward(precomputed_dpo):
    """The reference forward runs under no_grad after the policy's and frees its activations as it goes, so on this
    model the step's peak (in the backward) is the same either way; precomputed, the batch carries the two
    reference log-probs of each pair (float32) instead, and nothing else changes."""
    kwargs = dict(seq_len=32, target_batch_size=4, device="cpu", device_memory=64 * 2**30, budget_bytes=512 * MiB,
                  pairs="dpo", also=(1, 2, 4), all_peaks=False)
    forward = estimate_model(_dpo_build(), **kwargs)
    precomputed = precomputed_dpo  # these kwargs, the reference log-probs precomputed
    assert all(precomputed.peaks[m] - forward.peaks[m] == 2 * 4 * m for m in (1, 2, 4))
    assert "precomputed" in precomputed.loss and "adapters disabled" in forward.loss


def test_full_dpo_holds_a_frozen_reference_copy():
    """Full fine-tuning without precomputed log-probs: TRL loads a second copy of the model as the reference; its
    weights are held beside the policy's, so the step starts from that many more bytes."""
    # all_peaks=False: only the search's first trial (its baseline) and the loss line are read
    kwargs = dict(seq_len=16, target_batch_size=1, device="cpu", device_memory=64 * 2**30, budget_bytes=1024 * MiB,
                  pairs="dpo", all_peaks=False)
    copy = estimate_model(_dpo_build(lora=False), **kwargs)
    none = estimate_model(_dpo_build(lora=False), precompute_ref_log_probs=True, **kwargs)
    model = _dpo_build(lora=False)()
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert copy.result.measured_trials[0].baseline_bytes - none.result.measured_trials[0].baseline_bytes == weights
    assert "frozen copy" in copy.loss


@pytest.fixture(scope="module")
def reward_probe(tmp_path_factory):
    """AccumRewardTrainer's own probe on the tiny Llama with a scalar head and LoRA, on generated preference pairs."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model

    from hf_accum.trl import AccumRewardConfig, AccumRewardTrainer

    tokenizer = tiny.build_tokenizer()
    model = tiny.build_model("seq_cls", tokenizer=tokenizer, num_labels=1)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="SEQ_CLS",
                                             target_modules=DPO_TARGETS[:-1]))
    data = Dataset.from_list(tiny.generate_preference_data(64))
    args = AccumRewardConfig(output_dir=str(tmp_path_factory.mktemp("reward")), target_batch_size=16, auto_tune=True, use_cpu=True,
                             memory_budget_bytes=24 * MiB, gradient_checkpointing=False, max_length=64,
                             report_to=[], bf16=False, disable_tqdm=True)
    trainer = AccumRewardTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.tune()
    return trainer.probe_result, model


def test_a_reward_model_is_within_5_percent_of_its_trainers_probe(reward_probe):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    result, model = reward_probe
    config = model.get_base_model().config
    measured = _measured(result)

    def build():
        base = AutoModelForSequenceClassification.from_config(config)
        return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="SEQ_CLS",
                                               target_modules=DPO_TARGETS[:-1]))

    est = estimate_model(build, seq_len=result.extra["seq_len"], target_batch_size=16, device="cpu",
                         device_memory=64 * 2**30, budget_bytes=24 * MiB, pairs="reward", also=tuple(measured),
                         all_peaks=False)
    assert len(measured) >= 2
    for micro, peak in measured.items():
        assert abs(est.peaks[micro] / peak - 1) <= 0.05, (micro, peak, est.peaks[micro])
    assert abs(est.result.max_micro_batch_size - result.max_micro_batch_size) <= 1


@pytest.mark.parametrize("kwargs, words", [
    ({"pairs": "kto"}, "pairs='kto': give one of None, 'dpo', 'reward'"),
    ({"pairs": "reward"}, "pairs='reward' needs a sequence classification model with one label"),
    ({"precompute_ref_log_probs": True}, "precompute_ref_log_probs=True is for pairs='dpo'"),
])
def test_pairs_refusals_are_one_line(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        estimate_model(_dpo_build(), seq_len=8, target_batch_size=1, device="cpu", device_memory=2**30, **kwargs)
