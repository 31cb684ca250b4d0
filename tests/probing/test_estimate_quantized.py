"""Quantized bases on paper (issue 41 item 2): bitsandbytes' NF4 and LLM.int8 layers as stand-ins on fake tensors,
against the probe's measured CPU peak of the real bitsandbytes model on the same settings (CPU, checkpointing off on
both sides: the recipes pin it on, and checkpointing on paper is a separate lever)."""

import tempfile

import pytest
import torch

pytest.importorskip("bitsandbytes")

from hf_accum.probing.estimate import estimate_model  # noqa: E402
from hf_accum.probing.loading import add_lora, load_model  # noqa: E402
from hf_accum.probing.paper_quantized import quantized_model, settings  # noqa: E402
from hf_accum.probing.probe import probe_model  # noqa: E402

MiB = 2**20


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _lora(r=8, targets="all-linear", modules_to_save=None):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM",
                      modules_to_save=modules_to_save)


def _loaded(config, quantization, lora, dtype=torch.bfloat16):
    """The real model: saved, then loaded quantized by transformers/bitsandbytes, with peft's LoRA on top."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp:
        base.save_pretrained(tmp)
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, device_map={"": "cpu"},
                                                     quantization_config=BitsAndBytesConfig(**settings(quantization)))
    return add_lora(model, lora, quantized=True)


def _paper(config, lora, dtype=torch.bfloat16):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    return lambda: get_peft_model(AutoModelForCausalLM.from_config(config, dtype=dtype), lora)


def _against_probe(real, build, quantization, *, seq_len, target, budget):
    result, _ = probe_model(real, seq_len=seq_len, target_batch_size=target, budget_bytes=budget)
    measured = {t.micro_batch_size: t.peak_bytes for t in result.measured_trials if t.peak_bytes}
    est = estimate_model(build, seq_len=seq_len, target_batch_size=target, device="cpu", device_memory=64 * 2**30,
                         budget_bytes=budget, quantization=quantization, also=tuple(measured), all_peaks=False)
    return measured, result.max_micro_batch_size, est


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_a_quantized_qwen2_with_lora_is_within_5_percent_of_the_cpu_probe(quantization):
    config = _qwen2()
    measured, largest, est = _against_probe(_loaded(config, quantization, _lora()), _paper(config, _lora()),
                                            quantization, seq_len=128, target=8, budget=12 * MiB)
    assert len(measured) >= 2 and 1 <= largest < 8
    for micro, peak in measured.items():
        assert abs(est.peaks[micro] / peak - 1) <= 0.05, (quantization, micro, peak, est.peaks[micro])
    assert abs(est.result.max_micro_batch_size - largest) <= 1


@pytest.mark.parametrize("budget_mib", [40, 12])
def test_the_qlora_recipes_model_is_within_5_percent_of_the_cpu_probe(budget_mib):
    """qlora_sft's base and LoRA exactly (tiny Llama, bf16, NF4 double-quantized computing in bf16, r=16 on every
    linear layer and embed_tokens, lm_head a trained copy) and 128 tokens, on its 40 MiB budget (everything up to
    the target fits) and on 12 MiB (the largest fit is found below it); the loss is the model's own on both sides
    (the recipe's trainer, TRL's fused LM head, is the recipe mapping's to model)."""
    from hf_accum import recipes, tiny

    recipe = recipes.load_recipe("qlora_sft")
    m = recipe.model
    lora = recipe.lora_config()
    tokenizer = tiny.build_tokenizer()
    real = add_lora(load_model("tiny", dtype=torch.bfloat16, quantization=m.quantization, device="cpu",
                               tokenizer=tokenizer, tiny=m.tiny), lora, quantized=True)
    config = tiny.build_model(tokenizer=tokenizer, **m.tiny).config
    measured, largest, est = _against_probe(real, _paper(config, recipe.lora_config()), "nf4", seq_len=128,
                                            target=16, budget=budget_mib * MiB)
    assert len(measured) >= 2
    for micro, peak in measured.items():
        assert abs(est.peaks[micro] / peak - 1) <= 0.05, (micro, peak, est.peaks[micro])
    assert abs(est.result.max_micro_batch_size - largest) <= 1


def _storage(model):
    return {name: (tuple(t.shape), t.dtype) for name, t in {**dict(model.named_parameters()),
                                                             **dict(model.named_buffers())}.items()}


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_the_stand_in_stores_what_bitsandbytes_stores(quantization):
    """Per layer: NF4 double-quantized packs two weights a byte, one uint8 absmax per 64-block, one float32 absmax per
    256 of those, the 256-entry code and the offset; int8 one byte per weight and a float32 scale per row. Read off
    the real loaded layer, not restated."""
    from transformers import AutoModelForCausalLM

    config = _qwen2()
    real = _loaded(config, quantization, _lora()).get_base_model().model.layers[0].mlp.down_proj.base_layer
    with torch.device("meta"):
        paper = quantized_model(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), quantization)
    stand_in = paper.model.layers[0].mlp.down_proj
    assert type(real).__name__ in type(stand_in).__mro__[1].__name__
    if quantization == "nf4":
        state = real.weight.quant_state
        assert (tuple(real.weight.shape), real.weight.dtype) == _storage(stand_in)["weight"]
        assert (tuple(state.absmax.shape), state.absmax.dtype) == _storage(stand_in)["absmax"]
        assert (tuple(state.state2.absmax.shape), state.state2.absmax.dtype) == _storage(stand_in)["absmax2"]
        assert (tuple(state.state2.code.shape), state.state2.code.dtype) == _storage(stand_in)["code2"]
        assert (tuple(state.code.shape), state.code.dtype) == _storage(stand_in)["code"]
    else:
        assert (tuple(real.weight.shape), real.weight.dtype) == _storage(stand_in)["weight"]
        assert (tuple(real.weight.SCB.shape), real.weight.SCB.dtype) == _storage(stand_in)["SCB"]
    assert type(paper.lm_head) is torch.nn.Linear  # transformers keeps the output layer unquantized


def test_the_estimates_resident_bytes_are_bitsandbytes_storage():
    """What the step starts from (weights, buffers, gradients, optimizer state) differs between a bf16 base and a
    quantized one by exactly the linear layers' storage: bf16 2 bytes a weight; int8 1 byte a weight and a float32
    scale a row; NF4 half a byte a weight, a uint8 absmax a 64-block, a float32 one per 256 of those, the 256- and
    16-entry codes and the offset."""
    from transformers import AutoModelForCausalLM

    config = _qwen2()
    build = _paper(config, _lora())
    # all_peaks=False: only the search's first trial is read (its baseline), not the sizes past the search
    kwargs = dict(seq_len=16, target_batch_size=1, device="cpu", device_memory=64 * 2**30, budget_bytes=512 * MiB,
                  all_peaks=False)
    plain, nf4, int8 = (estimate_model(build, quantization=q, **kwargs).result.measured_trials[0].baseline_bytes
                        for q in (None, "nf4", "int8"))
    shapes = [(m.out_features, m.in_features) for name, m in AutoModelForCausalLM.from_config(config).named_modules()
              if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    bf16 = sum(2 * o * i for o, i in shapes)
    int8_bytes = sum(o * i + 4 * o for o, i in shapes)
    blocks = [-(-o * i // 64) for o, i in shapes]
    nf4_bytes = sum((o * i + 1) // 2 + b + 4 * -(-b // 256) + 4 * 256 + 4 * 16 + 4 for (o, i), b in zip(shapes, blocks))
    assert plain - int8 == bf16 - int8_bytes
    assert plain - nf4 == bf16 - nf4_bytes


def test_an_unknown_quantization_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"quantization='fp8': give one of None, 'nf4', 'int8'"):
        estimate_model(_paper(_qwen2(), _lora()), seq_len=8, target_batch_size=1, device="cpu",
                       device_memory=2**30, quantization="fp8")


def test_cli_estimate_with_load_in_4bit_runs(tmp_path, capsys):
    from hf_accum.cli import main

    _qwen2().save_pretrained(tmp_path)
    code = main(["probe", "--estimate", "--model", str(tmp_path), "--load-in-4bit", "--device", "cpu",
                 "--device-memory", "1GiB", "--seq-len", "32", "--target-batch", "2", "--budget-bytes", str(8 * MiB)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "(linear layers NF4, bitsandbytes' storage)" in out and "predicted peak per micro-batch" in out
