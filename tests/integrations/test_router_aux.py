"""TRL's MoE router auxiliary loss keeps TRL's meaning under hf_accum (router_aux.py): coef x its mean over the
window's forwards, never scaled by the forward's token or pair share; the token / pair loss stays exact. The
reference is TRL's own trainer on the same tiny Qwen3-MoE, batches and SGD step: equal (micro-batches of equal
pair count for DPO, whose TRL loss is a mean of micro-batch means) weights after one optimizer step."""

import copy

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from hf_accum import tiny  # noqa: E402
from hf_accum.integrations.trl import router_aux  # noqa: E402
from hf_accum.trl import AccumDPOConfig, AccumDPOTrainer, AccumSFTConfig, AccumSFTTrainer  # noqa: E402
from tests.integrations.test_dpo import preference_data  # noqa: E402

COEF = 1.0  # large, so that a term scaled by 1/GA moves the weights far beyond the tolerance


def tiny_moe(tok):
    config = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen3MoeForCausalLM(config)  # float32: the grouped expert matmul takes no float64


COMMON = dict(per_device_train_batch_size=2, max_steps=1, learning_rate=1.0, optim="sgd", max_grad_norm=0.0,
              logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0, disable_tqdm=True,
              max_length=64, gradient_checkpointing=False, router_aux_loss_coef=COEF)


def _sft_data():
    rows = tiny.generate_instruction_data(12, seed=1)
    return Dataset.from_list([{"prompt": r["prompt"], "completion": r["response"]} for r in rows])


def _train(trainer_cls, args, data, tok, model):
    trainer = trainer_cls(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    return trainer, loss, {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def _assert_same_step(ours, theirs, initial):
    (_, our_loss, our_weights), (_, their_loss, their_weights) = ours, theirs
    assert our_loss == pytest.approx(their_loss, rel=1e-5)
    moved = max(float((their_weights[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3  # the step did something to compare
    gate = [k for k in initial if "mlp.gate." in k]
    assert gate  # the router weights: their gradient comes from the aux term and the token loss
    for k in initial:
        assert torch.allclose(our_weights[k], their_weights[k], rtol=0, atol=1e-5), k


@pytest.mark.parametrize("accum", [1, 2, 3])
def test_sft_router_loss_is_trls_mean_over_the_windows_forwards(tmp_path, accum):
    tok = tiny.build_tokenizer()
    model = tiny_moe(tok)
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    theirs = _train(SFTTrainer, SFTConfig(output_dir=str(tmp_path / "trl"), gradient_accumulation_steps=accum,
                                          **COMMON), _sft_data(), tok, copy.deepcopy(model))
    ours = _train(AccumSFTTrainer, AccumSFTConfig(output_dir=str(tmp_path / "ours"), gradient_accumulation_steps=accum,
                                                  target_batch_size=2 * accum, auto_tune=False, **COMMON),
                  _sft_data(), tok, model)
    assert router_aux.enabled(ours[0]) and ours[0].router_aux_loss_coef == COEF  # restored after each forward
    _assert_same_step(ours, theirs, initial)


@pytest.mark.parametrize("accum", [1, 2, 3])
def test_dpo_on_an_moe_model_trains_with_trls_router_loss(tmp_path, accum):
    tok = tiny.build_tokenizer()
    model = tiny_moe(tok)
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    dpo = dict(beta=0.1, precompute_ref_log_probs=True, **COMMON)
    theirs = _train(DPOTrainer, DPOConfig(output_dir=str(tmp_path / "trl"), gradient_accumulation_steps=accum, **dpo),
                    preference_data(12), tok, copy.deepcopy(model))
    ours = _train(AccumDPOTrainer, AccumDPOConfig(output_dir=str(tmp_path / "ours"),
                                                  gradient_accumulation_steps=accum, target_batch_size=2 * accum,
                                                  auto_tune=False, **dpo),
                  preference_data(12), tok, model)
    assert ours[0].aux_loss_enabled
    _assert_same_step(ours, theirs, initial)


def test_fused_loss_off_with_a_router_loss_is_refused(tmp_path):
    tok = tiny.build_tokenizer()
    args = AccumSFTConfig(output_dir=str(tmp_path), fused_loss=False, auto_tune=False, **COMMON)
    with pytest.raises(ValueError, match="fused_loss=False .* router loss"):
        AccumSFTTrainer(model=tiny_moe(tok), args=args, train_dataset=_sft_data(), processing_class=tok)


def test_trl_still_names_its_router_loss_as_router_aux_reads_it(tmp_path):
    # router_aux.py reads trainer.aux_loss_enabled / router_aux_loss_coef and the forward's output.aux_loss
    tok = tiny.build_tokenizer()
    model = tiny_moe(tok)
    trainer = SFTTrainer(model=model, args=SFTConfig(output_dir=str(tmp_path), **COMMON), train_dataset=_sft_data(),
                         processing_class=tok)
    assert trainer.aux_loss_enabled is True and trainer.router_aux_loss_coef == COEF
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "output_router_logits": True}
    assert model(**batch).aux_loss.requires_grad


def test_check_accumulation_on_an_moe_model_compares_the_token_loss(tmp_path):
    # one forward over 4 rows vs 2 forwards of 2: the router term differs by design (a per-forward statistic), so
    # the check leaves it out of both passes; the token loss must agree
    tok = tiny.build_tokenizer()
    args = AccumSFTConfig(output_dir=str(tmp_path), auto_tune=False, **{**COMMON, "per_device_train_batch_size": 4})
    trainer = AccumSFTTrainer(model=tiny_moe(tok), args=args, train_dataset=_sft_data(), processing_class=tok)
    result = trainer.check_accumulation(num_micro_batches=2)
    assert result.passed and result.relative_error < 1e-4, result
    assert trainer.router_aux_loss_coef == COEF
