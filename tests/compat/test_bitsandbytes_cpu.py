"""Issue 44: bitsandbytes' CPU inference packing (`compat/bitsandbytes_cpu.py`). A `Linear4bit` that runs once in
eval mode without grad on a CPU with AVX512-BF16 converts its weight for good into a layout whose forward has no
autograd kernel: LoRA gradients below it are silently wrong, and with a bias (Qwen2's q/k/v) training crashes.

Each test runs twice: "native" (bitsandbytes' own CPU detection; skipped, saying so, where the CPU lacks
AVX512-BF16) and "forced" (the layers' flag forced on as on such a CPU, which runs everywhere). The references are
the same model never run in eval mode, or a run without evaluation: the guard must not change a single number."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from peft import LoraConfig  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

from hf_accum import AccumTrainer, AccumTrainingArguments, tiny  # noqa: E402
from hf_accum.compat import bitsandbytes_cpu  # noqa: E402
from hf_accum.probing.loading import add_lora, load_model  # noqa: E402
from tests.exactness import relative_error  # noqa: E402

QUANTIZATION = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.float32}


@pytest.fixture(params=["native", "forced"])
def packing(request, monkeypatch):
    """Where bitsandbytes would pack: natively (this CPU has AVX512-BF16) or with its detection forced on, as it is
    read when each Linear4bit is built."""
    if request.param == "native":
        if not bnb.functional.has_avx512bf16():
            pytest.skip("this CPU lacks AVX512-BF16: bitsandbytes never packs here (the 'forced' variant runs)")
    else:
        monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)
    return request.param


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)


def layer(bias=False):
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 64, bias=bias)
    four = bnb.nn.Linear4bit(64, 64, bias=bias, compute_dtype=torch.float32, quant_type="nf4")
    four.load_state_dict(dense.state_dict())
    return four.to("cpu")  # quantizes


def packed_layers(model):
    return [name for name, m in bitsandbytes_cpu.four_bit_layers(model) if bitsandbytes_cpu.is_packed(m)]


def qlora(tok, **tiny_kw):
    model = load_model("tiny", quantization=QUANTIZATION, device="cpu", tokenizer=tok, tiny=tiny_kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # LoRA B non-zero, so every adapter has a gradient from the first step
        return add_lora(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False,
                                          task_type="CAUSAL_LM"), quantized=True)


def lora_grads(model, batch):
    model.train()
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    return {n: g.detach().clone() for n, g in grads.items()}


def batch(tok, n=2):
    return tiny.SFTCollator(tok)([tiny.build_sft_dataset(8, tok, seed=5)[i] for i in range(n)])


def args(tmp_path, **kw):
    # probe_from_estimate=False here and below: the seed says only where the search starts (tests/probing/
    # test_estimate_quantized.py tests the 4-bit estimate); a 4-bit base's estimate costs seconds of fake steps
    return AccumTrainingArguments(**{**dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no",
                                            disable_tqdm=True, per_device_train_batch_size=2, seed=0,
                                            probe_from_estimate=False), **kw})


# --- the mechanism, pinned: fails when bitsandbytes changes it --------------------------------------------------
def test_bitsandbytes_packs_a_linear4bit_for_good_on_one_eval_forward_where_flagged(forced):
    four = layer()
    assert getattr(four, bitsandbytes_cpu.FLAG) is True
    four.eval()
    with torch.no_grad():
        four(torch.randn(3, 64))
    assert bitsandbytes_cpu.is_packed(four)  # the layout hf_accum keeps out
    four.train()
    x = torch.randn(3, 64, requires_grad=True)
    four(x).sum().backward()  # training forwards stay on the packed path...
    assert bitsandbytes_cpu.is_packed(four)
    if bnb.functional.has_avx512bf16():  # ...whose AVX512-BF16 kernel has no autograd: the gradient is dropped
        assert x.grad is None
    else:  # ...which bitsandbytes' default kernel reads as the unpacked layout: a gradient, but not the layer's
        unpacked, y = layer(), x.detach().clone().requires_grad_()
        unpacked(y).sum().backward()
        assert x.grad is not None and not torch.allclose(x.grad, y.grad, atol=1e-2)


def test_keep_unpacked_turns_the_flag_off_so_eval_forwards_match_training_ones(forced):
    four = layer(bias=True)
    x = torch.randn(3, 64)
    with torch.no_grad():
        training = four(x)
    bitsandbytes_cpu.keep_unpacked(torch.nn.Sequential(four))
    four.eval()
    with torch.no_grad():
        evaluated = four(x)
    assert not bitsandbytes_cpu.is_packed(four) and torch.equal(evaluated, training)


def test_a_layer_packed_before_is_converted_back_with_bitsandbytes_inverse(forced, caplog):
    four = layer()
    original = four.weight.data.clone()
    four.eval()
    with torch.no_grad():
        four(torch.randn(3, 64))
    assert bitsandbytes_cpu.is_packed(four)
    with caplog.at_level(logging.WARNING, logger="hf_accum.trainer"):
        assert bitsandbytes_cpu.keep_unpacked(torch.nn.Sequential(four)) == 1
    assert "were in bitsandbytes' CPU inference layout" in caplog.text
    assert not bitsandbytes_cpu.is_packed(four) and torch.equal(four.weight.data, original)
    four.train()
    x = torch.randn(3, 64, requires_grad=True)
    four(x).sum().backward()
    assert x.grad is not None


def test_a_bitsandbytes_without_the_flag_is_refused_in_one_line(forced):
    """Where bitsandbytes still packs but the flag hf_accum turns off is gone, nothing keeps the layout out: refused
    (before any forward of ours, so before the first optimizer step)."""
    four = layer()
    del four.support_avx512bf16_for_cpu
    with pytest.raises(RuntimeError, match=r"no longer has `support_avx512bf16_for_cpu`") as info:
        bitsandbytes_cpu.keep_unpacked(torch.nn.Sequential(four))
    assert "\n" not in str(info.value)


def test_a_model_from_model_init_is_kept_unpacked_too(forced, tmp_path):
    """`Trainer.train` makes a new model from ``model_init``: the guard reaches it before the first step."""
    tok = tiny.build_tokenizer()
    trainer = AccumTrainer(model_init=lambda: qlora(tok), args=args(tmp_path, max_steps=1),
                           train_dataset=tiny.build_sft_dataset(4, tok), data_collator=tiny.SFTCollator(tok))
    first = trainer.model
    trainer.train()
    assert trainer.model is not first
    layers = bitsandbytes_cpu.four_bit_layers(trainer.model)
    assert layers and not any(getattr(m, bitsandbytes_cpu.FLAG) for _, m in layers)


# --- the reproductions of the issue --------------------------------------------------------------------------------
def test_lora_gradients_after_evaluate_equal_those_of_a_model_never_in_eval_mode(packing, tmp_path):
    tok = tiny.build_tokenizer()
    model = qlora(tok)
    never_evaluated = copy.deepcopy(model)
    data = tiny.build_sft_dataset(8, tok)
    trainer = AccumTrainer(model=model, args=args(tmp_path), train_dataset=data, eval_dataset=data,
                           data_collator=tiny.SFTCollator(tok))
    assert trainer.check_accumulation(num_micro_batches=2).passed
    trainer.evaluate()
    model.eval()
    with torch.no_grad():  # and a user's own eval-mode forward (generate, a callback) after the trainer adopted it
        model(**batch(tok))
    want = lora_grads(never_evaluated, batch(tok))
    assert relative_error(lora_grads(model, batch(tok)), want) <= 1e-6
    assert packed_layers(model) == []


def test_lora_gradients_after_a_probe_equal_those_of_a_model_never_in_eval_mode(packing, tmp_path):
    """The probe with its fused-loss check (one eval-mode forward) before training: on main 88 of a 4-step run's
    forwards went through gemv_4bit."""
    tok = tiny.build_tokenizer()
    model = qlora(tok)
    never_evaluated = copy.deepcopy(model)
    trainer = AccumTrainer(model=model, args=args(tmp_path, target_batch_size=4, probe_max_micro_batch=2,
                                                   memory_budget_bytes=1 << 30),
                           train_dataset=tiny.build_sft_dataset(8, tok), data_collator=tiny.SFTCollator(tok))
    trainer.tune()
    assert trainer.fused_loss_active is not None and trainer.probe_result is not None
    assert relative_error(lora_grads(model, batch(tok)), lora_grads(never_evaluated, batch(tok))) <= 1e-6
    assert packed_layers(model) == []


@pytest.fixture
def qwen2_with_bias(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = tiny.build_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path / "qwen2"
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_the_probe_of_a_4bit_qwen2_with_bias_runs(packing, qwen2_with_bias, capsys):
    """On main: `RuntimeError: a view of a leaf Variable that requires grad is being used in an in-place operation`
    (matmul_4bit's `result += bias` on the packed path), after the fused loss's eval-mode check packed the layers."""
    from hf_accum.cli import main

    rc = main(["probe", "--model", qwen2_with_bias, "--lora", "--load-in-4bit", "--seq-len", "16", "--target-batch",
               "4", "--max-micro-batch", "2", "--budget-bytes", str(1 << 30)])
    assert rc == 0
    assert "plan: micro 2 × accumulation 2 × world 1 = 4" in capsys.readouterr().out


def test_the_qlora_recipe_on_a_qwen2_with_bias_evaluates_and_trains(packing, qwen2_with_bias, tmp_path):
    """`hf-accum train qlora_sft` with evaluation during training (on main, 448 forwards of a 6-step run went through
    gemv_4bit after the first evaluation; on a biased model the first training forward after it crashed)."""
    from hf_accum import recipes

    run = recipes.run_recipe("qlora_sft", [
        f"model.name={qwen2_with_bias}", "data.num_examples=40", "data.eval_examples=8",
        "eval_strategy=steps", "eval_steps=1", "max_steps=2", "target_batch_size=4", "disable_tqdm=true",
        f"output_dir={tmp_path / 'run'}"], say=lambda _msg: None)
    assert run.trainer.state.global_step == 2
    assert [e["step"] for e in run.trainer.state.log_history if "eval_loss" in e][:2] == [1, 2]
    assert any(m.bias is not None for _, m in bitsandbytes_cpu.four_bit_layers(run.model))
    assert packed_layers(run.model) == []


# --- evaluation during training changes nothing: the three trainers, a run with and without it ---------------------
def train_and_keep_weights(make_trainer, evaluate: bool):
    trainer = make_trainer(dict(eval_strategy="steps", eval_steps=2) if evaluate else {})
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    assert trainer.state.global_step == 4
    evaluations = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert len(evaluations) == (2 if evaluate else 0)
    weights = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return weights, packed_layers(trainer.model)


def accum_trainer(tmp_path, tok):
    """With a target (the probe runs). The fused loss's check is an eval-mode forward before training, in both runs:
    it is off here, so that the run without evaluation is a sound reference (the probe test covers the check)."""
    data = tiny.build_sft_dataset(24, tok)

    def make(kw):
        return AccumTrainer(model=qlora(tok), args=args(tmp_path, max_steps=4, learning_rate=1e-2, target_batch_size=4,
                                                        probe_max_micro_batch=2, memory_budget_bytes=1 << 30,
                                                        fused_loss=False, **kw),
                            train_dataset=data, eval_dataset=tiny.build_sft_dataset(6, tok, seed=3),
                            data_collator=tiny.SFTCollator(tok))
    return make


def sft_trainer(tmp_path, tok):
    from datasets import Dataset

    from hf_accum.trl import AccumSFTConfig, AccumSFTTrainer

    rows = [{"prompt": r["prompt"], "completion": r["response"]} for r in tiny.generate_instruction_data(30, seed=1)]

    def make(kw):
        config = AccumSFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                                disable_tqdm=True, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                                max_steps=4, learning_rate=1e-2, max_length=64, seed=0, probe_from_estimate=False, **kw)
        return AccumSFTTrainer(model=qlora(tok), args=config, train_dataset=Dataset.from_list(rows[:24]),
                               eval_dataset=Dataset.from_list(rows[24:]), processing_class=tok)
    return make


def dpo_trainer(tmp_path, tok):
    from datasets import Dataset

    from hf_accum.trl import AccumDPOConfig, AccumDPOTrainer

    rows = [{"prompt": r["prompt"], "chosen": r["response"], "rejected": r["response"][::-1] + " no"}
            for r in tiny.generate_instruction_data(20, seed=2)]

    def make(kw):
        config = AccumDPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                                disable_tqdm=True, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                                max_steps=4, learning_rate=1e-2, max_length=64, seed=0, probe_from_estimate=False, beta=0.1,
                                gradient_checkpointing=False, **kw)
        return AccumDPOTrainer(model=qlora(tok), args=config, train_dataset=Dataset.from_list(rows[:16]),
                               eval_dataset=Dataset.from_list(rows[16:]), processing_class=tok)
    return make


@pytest.mark.parametrize("trainer_kind", [accum_trainer, sft_trainer, dpo_trainer],
                         ids=["AccumTrainer", "AccumSFTTrainer", "AccumDPOTrainer"])
def test_evaluating_every_two_steps_ends_with_the_weights_of_a_run_without_evaluation(forced, tmp_path, trainer_kind):
    """Forced only: on a CPU with AVX512-BF16 it is the native path, and elsewhere it is the path such a CPU takes."""
    make = trainer_kind(tmp_path, tiny.build_tokenizer())
    without, packed_without = train_and_keep_weights(make, evaluate=False)
    assert packed_without == []  # the reference never ran in eval mode
    evaluated, packed = train_and_keep_weights(make, evaluate=True)
    assert without.keys() == evaluated.keys() and len(without) > 0
    assert relative_error(evaluated, without) <= 1e-6
    assert packed == []
