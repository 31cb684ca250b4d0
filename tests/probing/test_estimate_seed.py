"""The real probe started from the estimate (`probing.seed.probe_with_estimate`): fewer trials, the same measured
answer, and one log line and today's search whenever the estimate cannot stand for the step."""

from __future__ import annotations

import pytest
import torch

from hf_accum.probing import seed as seed_module
from hf_accum.probing.probe import probe_model
from hf_accum.probing.seed import probe_with_estimate

MiB = 2**20
PROBE = dict(seq_len=128, target_batch_size=8, budget_bytes=12 * MiB)


def _llama(layers=2, **kw):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, **kw)


@pytest.fixture(autouse=True)
def no_estimate_made_before(monkeypatch):
    """Each test here makes its own estimates (some replace `estimate_model`): none made by an earlier test is
    reused (`seed.MADE`)."""
    from collections import OrderedDict

    monkeypatch.setattr(seed_module, "MADE", OrderedDict())


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0,
                                            task_type="CAUSAL_LM"))


@pytest.fixture(scope="module")
def plain_llama():
    """The unseeded probe of `_llama()` (seed 0: every call builds the same weights) with `PROBE`: (result, plan), the
    answer the tests below compare a seeded probe of a fresh `_llama()` with. Read only."""
    return probe_model(_llama(), **PROBE)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_estimate_seeds_the_search_and_the_answer_stays_measured(lora):
    model = _lora(_llama()) if lora else _llama()
    plain, plain_plan = probe_model(model, **PROBE)
    said = []
    seeded, plan = probe_with_estimate(model, log=said.append, **PROBE)
    assert seeded.max_micro_batch_size == plain.max_micro_batch_size and plan == plain_plan
    estimate = seeded.extra["estimate"]
    assert estimate["largest_fit"] == seeded.max_micro_batch_size  # like for like on CPU the estimate is right
    sizes = [t.micro_batch_size for t in seeded.trials]
    right = seeded.max_micro_batch_size
    assert sizes == [right, right + 1] and len(sizes) <= len(plain.trials), (sizes, plain.trials)
    assert [t.fits for t in seeded.trials] == [True, False]  # measured: the size above did not fit
    measured = {t.micro_batch_size: t.peak_bytes for t in seeded.trials}
    for micro, predicted in estimate["peaks"].items():  # the record: the estimate's own peaks, within 5%
        if int(micro) in measured:
            assert abs(predicted / measured[int(micro)] - 1) <= 0.05
    assert any("estimate (cpu, fake tensors" in line for line in said)


def test_a_wrong_estimate_costs_trials_not_the_answer(monkeypatch, plain_llama):
    model = _llama()
    plain, _ = plain_llama
    real = seed_module.estimate_model

    def too_high(*args, **kwargs):
        est = real(*args, **kwargs)
        est.result.max_micro_batch_size = 8  # the estimate says everything fits
        return est

    monkeypatch.setattr(seed_module, "estimate_model", too_high)
    seeded, _ = probe_with_estimate(model, **PROBE)
    assert seeded.trials[0].micro_batch_size == 8 and not seeded.trials[0].fits
    assert seeded.max_micro_batch_size == plain.max_micro_batch_size
    assert seeded.extra["estimate"]["largest_fit"] == 8


def test_a_failing_estimate_says_so_in_one_line_and_searches_as_before(monkeypatch, plain_llama):
    model = _llama()
    plain, _ = plain_llama

    def broken(*_args, **_kwargs):
        raise RuntimeError("no fake kernel for this op\nsecond line")

    monkeypatch.setattr(seed_module, "estimate_model", broken)
    said = []
    seeded, _ = probe_with_estimate(model, log=said.append, **PROBE)
    failed = [line for line in said if line.startswith("estimate failed")]
    assert failed == ["estimate failed (RuntimeError: no fake kernel for this op): the search starts from "
                      "micro-batch 1"]
    assert [t.micro_batch_size for t in seeded.trials] == [t.micro_batch_size for t in plain.trials]
    assert seeded.max_micro_batch_size == plain.max_micro_batch_size and "estimate" not in seeded.extra


def test_a_quantization_not_modelled_is_not_estimated_one_line_and_todays_search():
    """NF4 and int8 bases are estimated (`paper_quantized.py`); a 4-bit load's default FP4 is not."""
    model = _llama()
    model.config.quantization_config = {"load_in_4bit": True}  # what a 4-bit FP4 load leaves on the config
    plain, _ = probe_model(model, **PROBE)
    said = []
    seeded, _ = probe_with_estimate(model, log=said.append, **PROBE)
    assert [line for line in said if line.startswith("estimate")] == [
        "estimate skipped (a fp4 4-bit base is not modelled (bitsandbytes' NF4 and int8 are)): the search starts "
        "from micro-batch 1"]
    assert [t.micro_batch_size for t in seeded.trials] == [t.micro_batch_size for t in plain.trials]
    assert "estimate" not in seeded.extra


def test_checkpointed_layers_are_estimated_checkpointed():
    model = _llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.model.layers[1].gradient_checkpointing = False  # one of two layers recomputes
    with torch.device("meta"):
        built = seed_module.builder_like(model)()
    assert [layer.gradient_checkpointing for layer in built.model.layers] == [True, False]
    plain, _ = probe_model(model, **PROBE)
    seeded, _ = probe_with_estimate(model, **PROBE)
    assert seeded.extra["estimate"]["largest_fit"] == seeded.max_micro_batch_size == plain.max_micro_batch_size
    assert len(seeded.trials) <= 2


@pytest.mark.parametrize("autocast, words", [(torch.float16, "float16 autocast")])
def test_unsupported_reasons(autocast, words):
    assert words in seed_module.unsupported_reason(_llama(), autocast)
    assert seed_module.unsupported_reason(_llama(), torch.bfloat16) is None
    assert "config" in seed_module.unsupported_reason(torch.nn.Linear(2, 2), None)


def test_the_rebuilt_model_trains_what_the_model_trains():
    model = _llama()
    model.model.embed_tokens.weight.requires_grad_(False)  # a frozen embedding: the estimate freezes it too
    with torch.device("meta"):
        built = seed_module.builder_like(model)()
    assert {n: p.requires_grad for n, p in built.named_parameters()} == {
        n: p.requires_grad for n, p in model.named_parameters()}


def test_the_report_shows_predicted_beside_measured(plain_llama):
    from hf_accum.probing.report import estimate_lines, predicted_vs_measured, summary, to_json

    result, plan = probe_with_estimate(_llama(), **PROBE)
    rows = predicted_vs_measured(result)
    assert [m for m, *_ in rows] == sorted(t.micro_batch_size for t in result.measured_trials)
    for micro, predicted, measured, how in rows:
        assert how in ("ran", "line") and abs(predicted / measured - 1) <= 0.05, (micro, predicted, measured)
    lines = estimate_lines(result)
    assert lines[0] == (f"estimate (cpu, fake tensors): largest fit {result.extra['estimate']['largest_fit']}, "
                        f"measured {result.max_micro_batch_size}")
    assert len(lines) == 1 + len(rows) and all(" predicted " in line and " measured " in line for line in lines[1:])
    assert "\n".join(lines) in summary(result, plan, PROBE["seq_len"])
    assert to_json(result, plan, PROBE["seq_len"])["estimate"] == result.extra["estimate"]
    plain, plain_plan = plain_llama
    assert estimate_lines(plain) == [] and "estimate" not in to_json(plain, plain_plan, PROBE["seq_len"])


@pytest.mark.parametrize("from_estimate", [True, False])
def test_the_trainer_starts_from_the_estimate_and_the_plan_file_records_it(tmp_path, from_estimate):
    # checkpoint_layers fixed: the plain micro-batch search (with "auto" each level is seeded: test_estimate_levels.py)
    import json

    from hf_accum import AccumTrainer, AccumTrainingArguments
    from hf_accum.planning.store import PLAN_FILE
    from hf_accum.tiny import SFTCollator, build_model, build_sft_dataset, build_tokenizer

    tok = build_tokenizer()
    args = AccumTrainingArguments(output_dir=str(tmp_path), target_batch_size=16, memory_budget_bytes=8 * MiB,
                                  use_cpu=True, report_to=[], max_steps=1, save_strategy="no", disable_tqdm=True,
                                  fused_loss=False, checkpoint_layers="0", probe_from_estimate=from_estimate)
    trainer = AccumTrainer(model=build_model(tokenizer=tok), args=args, train_dataset=build_sft_dataset(48, tok),
                           data_collator=SFTCollator(tok))
    trainer.tune()
    with open(tmp_path / PLAN_FILE) as f:
        probe = json.load(f)["probe"]
    result = trainer.probe_result
    if not from_estimate:
        assert "estimate" not in probe["extra"] and result.trials[0].micro_batch_size == 1
        return
    estimate = probe["extra"]["estimate"]  # beside what was measured: its largest fit, its peaks, its line
    assert estimate["largest_fit"] == result.extra["estimate"]["largest_fit"] >= 1
    assert estimate["peaks"] and len(estimate["fitted"]) == 2 and estimate["device"] == "cpu"
    assert result.trials[0].micro_batch_size == min(estimate["largest_fit"], 16)
    measured = {t["micro_batch_size"]: t["peak_bytes"] for t in probe["trials"] if t["peak_bytes"]}
    assert any(m in measured for m in map(int, estimate["peaks"]))


def test_a_trainer_with_its_own_loss_is_not_seeded(tmp_path, caplog):
    """The estimate models the model's own loss; TRL's SFT loss also builds entropy and accuracy from the logits
    (a new user's lora_sft probe was seeded at 16 for a measured 4): such a trainer searches as before and says why."""
    import json
    import logging

    from hf_accum import AccumTrainer, AccumTrainingArguments
    from hf_accum.planning.store import PLAN_FILE
    from hf_accum.probing.seed import trainer_reason
    from hf_accum.tiny import SFTCollator, build_model, build_sft_dataset, build_tokenizer

    class OwnLoss(AccumTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    tok = build_tokenizer()
    args = AccumTrainingArguments(output_dir=str(tmp_path), target_batch_size=16, memory_budget_bytes=8 * MiB,
                                  use_cpu=True, report_to=[], max_steps=1, save_strategy="no", disable_tqdm=True,
                                  fused_loss=False, checkpoint_layers="0")
    trainer = OwnLoss(model=build_model(tokenizer=tok), args=args, train_dataset=build_sft_dataset(48, tok),
                      data_collator=SFTCollator(tok))
    assert "OwnLoss.compute_loss" in trainer_reason(trainer)
    with caplog.at_level(logging.INFO, logger="hf_accum"):
        trainer.tune()
    with open(tmp_path / PLAN_FILE) as f:
        probe = json.load(f)["probe"]
    assert "estimate" not in probe["extra"] and trainer.probe_result.trials[0].micro_batch_size == 1
    assert sum("estimate skipped (OwnLoss.compute_loss" in r.getMessage() for r in caplog.records) == 1


def test_the_rebuilt_model_carries_trls_fused_head_and_the_trainers_dtypes():
    """As AccumSFTTrainer runs a QLoRA model: TRL's fused LM head on the base (its outputs), the adapters and the
    lm_head copy cast to bfloat16 (TRL on a quantized base); the rebuild has the same, and its step calls the head."""
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    from hf_accum.compat.trl_internals import fused_lm_head_outputs

    model = get_peft_model(_llama(), LoraConfig(r=8, target_modules="all-linear", modules_to_save=["lm_head"],
                                                task_type="CAUSAL_LM"))
    add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy"))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    built = seed_module.builder_like(model)()
    assert fused_lm_head_outputs(built.get_base_model()) == ("log_probs", "entropy")
    assert {n: p.dtype for n, p in built.named_parameters()} == {n: p.dtype for n, p in model.named_parameters()}
    ids = torch.randint(0, 256, (1, 8))
    out = built(input_ids=ids, labels=ids)  # the fused head: per-token log-probs of the shifted labels, no logits
    assert out.log_probs.shape == (1, 7) and "logits" not in out


@pytest.mark.parametrize("config, keywords", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
      "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"}, {"quantization": "nf4"}),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
     {"quantization": "nf4", "quantization_options": {"compute_dtype": torch.float32, "double_quant": False}}),
    ({"load_in_8bit": True}, {"quantization": "int8"}),
])
def test_the_estimate_quantizes_as_the_models_quantization_config(config, keywords):
    model = _llama()
    model.config.quantization_config = config
    assert seed_module.quantization_of(model) == keywords
    assert seed_module.unsupported_reason(model, None) is None


@pytest.mark.parametrize("build", ["tiny_bart", "tiny_t5"])
def test_an_encoder_decoder_is_rebuilt_as_its_own_class(build):
    """The rebuild was always AutoModelForCausalLM: BART's decoder alone ("its parameters differ"), T5 refused, so a
    Seq2Seq probe's estimate failed and its search started at micro-batch 1."""
    from tests import exactness

    model = getattr(exactness, build)()
    rebuilt = seed_module.builder_like(model)()
    assert type(rebuilt) is type(model)
    assert [n for n, _ in rebuilt.named_parameters()] == [n for n, _ in model.named_parameters()]


def test_an_estimate_is_made_once_per_process_for_the_same_model_and_settings(monkeypatch):
    made = []
    real = seed_module.estimate_model
    monkeypatch.setattr(seed_module, "estimate_model", lambda *a, **k: (made.append(k["budget_bytes"]), real(*a, **k))[1])
    said = []
    first, first_plan = probe_with_estimate(_llama(), log=said.append, **PROBE)
    again, again_plan = probe_with_estimate(_llama(), log=said.append, **PROBE)  # built again: the same model
    assert made == [PROBE["budget_bytes"]]
    assert again_plan == first_plan and again.extra["estimate"] == first.extra["estimate"]
    assert [t.micro_batch_size for t in again.trials] == [t.micro_batch_size for t in first.trials]
    assert sum("made earlier in this process for the same model and settings" in line for line in said) == 1, said
    probe_with_estimate(_llama(), log=said.append, **{**PROBE, "budget_bytes": 10 * MiB})  # another budget
    probe_with_estimate(_lora(_llama()), log=said.append, **PROBE)  # another model
    assert made == [PROBE["budget_bytes"], 10 * MiB, PROBE["budget_bytes"]]


def test_the_made_estimates_are_the_newest_few(monkeypatch):
    monkeypatch.setattr(seed_module, "MADE_LIMIT", 2)
    for key in "abc":
        record, _, how = seed_module.made_once(key, lambda key=key: ({"seconds": 1.0, "key": key}, None))
        assert how == "1.0 s" and record["key"] == key
    assert list(seed_module.MADE) == ["b", "c"]
    record, _, how = seed_module.made_once("b", lambda: pytest.fail("made again"))
    record["key"] = "changed"  # a caller's copy: the stored record stays as made
    assert how.startswith("made earlier") and seed_module.MADE["b"][0]["key"] == "b"


def test_the_builders_key_changes_with_whatever_the_estimate_depends_on():
    from peft import LoraConfig, get_peft_model

    def key(model):
        return seed_module.builder_like(model).key

    def frozen():
        model = _llama()
        model.model.embed_tokens.weight.requires_grad_(False)
        return model

    def checkpointed():
        model = _llama()
        model.gradient_checkpointing_enable({"use_reentrant": False})
        return model

    base = key(_llama())
    torch.manual_seed(1)
    assert key(_llama()) == base  # other weights, the same model: the same estimate
    changed = {
        "deeper": key(_llama(layers=3)), "attention": key(_llama(attn_implementation="eager")),
        "dtype": key(_llama().to(torch.bfloat16)), "frozen": key(frozen()), "checkpointed": key(checkpointed()),
        "lora": key(_lora(_llama())),
        "lora r": key(get_peft_model(_llama(), LoraConfig(r=4, lora_alpha=16, target_modules="all-linear",
                                                          lora_dropout=0.0, task_type="CAUSAL_LM"))),
    }
    assert base not in changed.values() and len(set(changed.values())) == len(changed), [
        name for name, k in changed.items() if k == base]


def test_a_model_sharded_by_fsdp2_is_seeded_by_its_ranks_estimate(monkeypatch):
    """Where FSDP2 shards the parameters over N ranks (`compat.parallel.fsdp2_shards`; a real launch is in
    tests/integrations/test_fsdp2.py), the seed is the sharded estimate's largest fit: the largest size up to the
    per-rank cap whose rank peak (`sharding.rank_peak` over the activations stepped on fake tensors) fits the budget,
    computed here independently from every size's peak."""
    from hf_accum.compat import parallel
    from hf_accum.probing.paper_sharded import FakeSteps
    from hf_accum.probing.seed import builder_like, seeder_for
    from hf_accum.probing.sharding import parse_sharding, rank_peak

    model = _llama()
    with FakeSteps(builder_like(model), seq_lens=[128], device="cpu", bf16=False) as steps:
        peaks = {m: rank_peak(steps.counts, parse_sharding("fsdp2"), 2, steps.activations(128, None, m),
                              steps.optimizer) for m in range(1, 9)}
    budget = (peaks[3] + peaks[4]) // 2
    monkeypatch.setattr(parallel, "fsdp2_shards", lambda m: 2 if m is model else None)
    said = []
    meter = type("Meter", (), {"capacity_bytes": lambda self: 2**34})()
    seed, record = seeder_for(model, seq_len=128, target_batch_size=16, world_size=2, log=said.append)(budget, meter)
    assert seed == 3 == max(m for m, p in peaks.items() if p <= budget)
    assert record["sharded"] == "FSDP2 over 2 ranks" and record["largest_fit"] == 3
    assert {int(m): p for m, p in record["peaks"].items()} == {m: peaks[m] for m in map(int, record["peaks"])}
    assert said[-1].startswith("estimate (cpu, fake tensors, FSDP2 over 2 ranks, ")
    assert said[-1].endswith("largest fit 3; the search starts there")
    # not sharded in place: the one-process estimate, as before
    monkeypatch.setattr(parallel, "fsdp2_shards", lambda m: None)
    _, whole = seeder_for(model, seq_len=128, target_batch_size=16, world_size=2, log=said.append)(budget, meter)
    assert "sharded" not in whole and "FSDP2" not in said[-1]
