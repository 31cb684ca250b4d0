"""Recipes on paper (issue 41 item 1): `hf-accum probe --estimate RECIPE` estimates what `hf-accum train RECIPE`
trains, like for like with the recipe's real probe on CPU; bare Qwen2-, GPT-NeoX- and Phi-3-style configs, full and
LoRA, and a classification head, like for like with the probe."""

import json

import pytest
import torch

from hf_accum.probing.estimate import estimate_model
from hf_accum.probing.estimate_check import against_probe
from hf_accum.probing.paper import with_lora

MiB = 2**20
pytestmark = pytest.mark.xdist_group("recipe_probe")  # the session's recipe probes (`recipe_probe`), each probed once


def _settings(name, *overrides):
    from hf_accum.recipes.config import load_recipe
    from hf_accum.recipes.recipe_paper import settings

    recipe = load_recipe(name, list(overrides))
    return settings(recipe, recipe.validate())


# --- the pure part: a recipe -> the estimate's keywords ------------------------------------------------------------
COMMON = {"target_batch_size": 16, "world_size": 1, "budget_fraction": None, "bf16": False, "max_micro_batch": None,
          "optimizer": {"fused": True}}


@pytest.mark.parametrize("name, head, keywords, lora, fused_head, dtype", [
    ("lora_sft", "causal_lm", {"budget_bytes": 80 * MiB, "checkpoint_layers": "all"},
     {"r": 16, "modules_to_save": ["lm_head"], "task_type": "CAUSAL_LM"}, True, None),
    ("qlora_sft", "causal_lm", {"budget_bytes": 40 * MiB, "checkpoint_layers": "all", "quantization": "nf4"},
     {"r": 16, "modules_to_save": ["lm_head"], "task_type": "CAUSAL_LM"}, True, "bfloat16"),
    ("lora_dpo", "causal_lm", {"budget_bytes": 64 * MiB, "checkpoint_layers": "all", "pairs": "dpo"},
     {"r": 16, "task_type": "CAUSAL_LM"}, False, None),
    ("lora_classification", "classification",
     {"budget_bytes": 2 * MiB, "checkpoint_layers": "all", "task": "classification"},
     {"r": 16, "task_type": "SEQ_CLS"}, False, None),
])
def test_each_recipe_on_paper(name, head, keywords, lora, fused_head, dtype):
    paper = _settings(name)
    assert paper.keywords == {**COMMON, **keywords}
    assert paper.head == head and paper.model == "tiny"
    assert paper.tiny == {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "seed": 0}
    assert {k: paper.lora.get(k) for k in lora} == lora
    assert "embed_tokens" in paper.lora["target_modules"]
    assert paper.trl_fused_head is fused_head and paper.dtype == dtype
    assert paper.bf16_adapters is (name == "qlora_sft")  # TRL casts a quantized base's adapters to bfloat16
    assert paper.device == "cpu" and paper.seq_len is None


def test_grpo_is_refused_in_one_line_naming_why():
    with pytest.raises(ValueError, match="does not model GRPO recipes: each optimizer step first generates") as exc:
        _settings("lora_grpo")
    assert "\n" not in str(exc.value) and "hf-accum probe lora_grpo" in str(exc.value)


@pytest.mark.parametrize("overrides, key, value", [
    (["gradient_checkpointing=false"], "checkpoint_layers", None),
    (["checkpoint_layers=1"], "checkpoint_layers", 1),
    (["gradient_checkpointing=null"], "checkpoint_layers", "auto"),  # unset: the tuner's level search
    (["memory_budget_bytes=null", "memory_budget=0.5"], "budget_fraction", 0.5),
    (["optim=adamw_torch"], "optimizer", {}),
    (["bf16=true"], "bf16", True),
    (["model.quantization.bnb_4bit_quant_type=fp4"], None, "NF4 4-bit bases"),
    (["model.quantization.bnb_4bit_use_double_quant=false"], "quantization_options",
     {"compute_dtype": torch.bfloat16, "double_quant": False}),
])
def test_overrides_reach_the_keywords(overrides, key, value):
    name = "qlora_sft" if any("quantization" in o for o in overrides) else "lora_sft"
    if key is None:
        with pytest.raises(ValueError, match=value):
            _settings(name, *overrides)
        return
    assert _settings(name, *overrides).keywords.get(key) == value


@pytest.mark.parametrize("name, overrides, seq_len", [
    ("lora_sft", [], 128), ("lora_classification", [], 16), ("lora_dpo", [], 57), ("lora_sft", ["probe_seq_len=96"], 96),
])
def test_the_length_is_the_one_the_probe_measures(name, overrides, seq_len):
    """The longest example as the trainer tokenizes it and the probe picks it (`planning.data_scan`): for lora_dpo,
    trainer-built, the probe's batch is 57 tokens wide: the widest pair, prompt + the longer completion (checked against `probe_batches` of the built trainer)."""
    from hf_accum.recipes.recipe_paper import data_length, prepare

    recipe, args, paper, tokenizer = prepare(name, overrides)
    assert data_length(recipe, args, paper, tokenizer)[0] == seq_len


def test_the_dpo_length_is_the_width_of_the_probes_batch():
    """Pins TRL's DPO dataset preparation as `compat.trl_internals.prepared_dataset` runs it without a model: the
    length the estimate reads is the width of the batch the built trainer's probe measures."""
    from hf_accum.planning.data_scan import probe_batches
    from hf_accum.recipes.recipe_paper import data_length, prepare
    from hf_accum.recipes.run import _load, build

    recipe, args, paper, tokenizer = prepare("lora_dpo", ["gradient_checkpointing=false"])
    on_paper = data_length(recipe, args, paper, tokenizer)[0]
    recipe, args = _load("lora_dpo", ["gradient_checkpointing=false"])
    make_batch, width = probe_batches(build(recipe, args, lambda _msg: None).trainer)
    assert on_paper == width == make_batch(2)["input_ids"].shape[1]


def test_fused_loss_false_is_the_models_own_loss_and_probe_seq_len_wins():
    paper = _settings("lora_sft", "fused_loss=false", "probe_seq_len=64")
    assert paper.trl_fused_head is False and paper.seq_len == 64


# --- like for like with the recipe's real probe (CPU) ---------------------------------------------------------
def _like_for_like(recipe_probe, name, *overrides):
    from hf_accum.recipes.recipe_paper import estimate_recipe

    probed = recipe_probe(name, *overrides)
    measured = {t.micro_batch_size: t.peak_bytes for t in probed.result.measured_trials if t.peak_bytes}
    # the probe first: the estimate steps the sizes it measured and its search ran, not the sizes between whose peaks
    # nothing here reads (every size 1 .. largest + 1: tests/probing/test_estimate.py)
    est, seq_len, _source, _paper = estimate_recipe(name, overrides, device="cpu", device_memory=64 * 2**30,
                                                    also=tuple(measured), all_peaks=False)
    # the same longest example, tokenized as the trainer tokenizes it (DPO: the widest collated pair, 57 tokens)
    assert seq_len == probed.seq_len
    assert measured
    for micro, peak in measured.items():
        assert abs(est.peaks[micro] / peak - 1) <= 0.05, (name, micro, est.peaks[micro], peak)
    assert abs(est.result.max_micro_batch_size - probed.result.max_micro_batch_size) <= 1
    return est, probed


@pytest.mark.parametrize("name", ["lora_sft", "lora_classification"])
def test_recipe_estimate_matches_its_probe_without_checkpointing(recipe_probe, name):
    est, probed = _like_for_like(recipe_probe, name, "gradient_checkpointing=false")
    assert est.plan.micro_batch_size == probed.plan.micro_batch_size


@pytest.mark.parametrize("name", ["lora_sft", "lora_classification", "lora_dpo", "qlora_sft"])
def test_recipe_estimate_matches_its_probe_as_the_recipe_pins_it(recipe_probe, name):
    """The recipes' own settings: gradient checkpointing pinned on every layer (and NF4, pairs)."""
    _like_for_like(recipe_probe, name)


def test_qlora_estimate_matches_its_probe_without_checkpointing(recipe_probe):
    _like_for_like(recipe_probe, "qlora_sft", "gradient_checkpointing=false")


def test_dpo_estimate_matches_its_probe_without_checkpointing(recipe_probe):
    _like_for_like(recipe_probe, "lora_dpo", "gradient_checkpointing=false")  # the probe of test_estimate_pairs.py


# --- the command --------------------------------------------------------------------------------------------
def test_cli_estimates_a_recipe_and_prints_the_trainers_plan_line(tmp_path, capsys):
    from hf_accum.cli import main

    out = tmp_path / "plan.json"
    code = main(["probe", "--estimate", "lora_classification", "gradient_checkpointing=false", "--device-memory",
                 "1GiB", "--json", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    lines = printed.out.strip().splitlines()
    assert lines[-1].startswith("hf_accum plan: micro 2 × accumulation 8 × world 1 = 16; peak ")
    assert lines[-1].endswith(" of budget 2.0 MiB; 2 probe trials (estimated)")
    assert "seq 16 (the longest of 2000 training examples)" in printed.out
    data = json.loads(out.read_text())
    assert data["estimated"] is True and data["recipe"] == "lora_classification" and data["seq_len"] == 16
    assert data["micro_batch_size"] == 2
    assert data["seq_len_source"] == "the longest of 2000 training examples"  # where the length came from


def test_cli_refuses_grpo_in_one_line(capsys):
    from hf_accum.cli import main

    assert main(["probe", "--estimate", "lora_grpo"]) == 2
    printed = capsys.readouterr()
    err = printed.err.strip().splitlines()
    assert len(err) == 1 and "does not model GRPO recipes" in err[0]
    assert printed.out == ""  # refused before anything is said or read


# --- bare configs, full and LoRA, and a classification head: like for like with the probe ---------------------
def _config(arch: str):
    from transformers import GPTNeoXConfig, Phi3Config, Qwen2Config

    if arch == "gpt_neox":
        return GPTNeoXConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=512)
    if arch == "phi3":
        return Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0)


@pytest.mark.parametrize("arch", ["qwen2", "gpt_neox", "phi3"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_bare_config_estimate_within_5_percent_of_the_cpu_probe(arch, lora):
    from transformers import AutoModelForCausalLM

    config = _config(arch)
    build = lambda: AutoModelForCausalLM.from_config(config)  # noqa: E731
    rows, measured_max, estimated_max, _est = against_probe(with_lora(build, 8, None) if lora else build,
                                                            seq_len=128, target_batch_size=8, budget_bytes=12 * MiB,
                                                            all_peaks=False)
    assert len(rows) >= 2
    for row in rows:
        assert abs(row.error) <= 0.05, (arch, lora, row)
    assert abs(estimated_max - measured_max) <= 1 and 1 <= measured_max < 8


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_classification_head_estimate_within_5_percent_of_the_cpu_probe(lora):
    from transformers import AutoModelForSequenceClassification

    config = _config("qwen2")
    config.num_labels = 3
    build = lambda: AutoModelForSequenceClassification.from_config(config)  # noqa: E731
    rows, measured_max, estimated_max, est = against_probe(
        with_lora(build, 8, None, "classification") if lora else build, seq_len=128, target_batch_size=8,
        budget_bytes=6 * MiB, task="classification", all_peaks=False)
    assert len(rows) >= 2
    for row in rows:
        assert abs(row.error) <= 0.05, (lora, row)
    assert abs(estimated_max - measured_max) <= 1 and 1 <= measured_max < 8
    assert "model's own" in est.loss  # no LM head: no fused loss


def test_estimate_refuses_an_unknown_task():
    with pytest.raises(ValueError, match="task='seq2seq': give one of causal_lm, classification"):
        estimate_model(lambda: None, seq_len=8, target_batch_size=2, device_memory=2**30, task="seq2seq")


def test_a_recipe_on_a_config_folder_builds_from_the_config_at_max_length(tmp_path, monkeypatch):
    """A model given as a folder holding only config.json (no weights) and a hub dataset: the model from its
    config, the length training.max_length, said so (nothing is downloaded)."""
    from hf_accum.recipes.recipe_paper import estimate_recipe

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _config("qwen2").save_pretrained(tmp_path)
    est, seq_len, source, paper = estimate_recipe(
        "lora_sft", [f"model={tmp_path}", "dataset=someone/sft-rows", "gradient_checkpointing=false", "training.max_length=64",
                      "memory_budget_bytes=null"],
        device="cpu", device_memory=2**30)
    assert (seq_len, source) == (64, "training.max_length (the data is not local)")
    assert paper.model == str(tmp_path) and est.result.max_micro_batch_size >= 16  # 0.9 GiB holds the whole target
    assert est.plan.micro_batch_size == 16


def test_the_qlora_build_holds_what_the_trainer_trains():
    """The recipe's model on the meta device: the tiny Llama from its keys in model.dtype, LoRA on every listed
    module, the lm_head copy trained (modules_to_save), and the trainable weights in bfloat16 as TRL casts them on a
    quantized base (the base's quantization itself is the estimate's `quantization` keyword)."""
    import torch

    from hf_accum.recipes.recipe_paper import builder, prepare

    _recipe, _args, paper, tokenizer = prepare("qlora_sft")
    with torch.device("meta"):
        model = builder(paper, tokenizer)()
    trainable = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    assert any("modules_to_save" in n and "lm_head" in n for n in trainable)
    assert any("embed_tokens" in n and "lora_embedding_A" in n for n in trainable)
    assert set(trainable.values()) == {torch.bfloat16}
    assert model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16
    assert len(model.get_base_model().model.layers) == 2 and model.config.hidden_size == 64
