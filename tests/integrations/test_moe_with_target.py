"""TRL's MoE training with a target batch: the probe, the evaluation and the eval-batch measurement call TRL's
`compute_loss` outside the Trainer's loop, where `current_gradient_accumulation_steps` (which TRL's SFT loss reads for
its router term) is not set yet. Each of these crashed with an AttributeError (TRL's own `test_train[tiny-GptOss...]`,
`[tiny-Qwen3Moe...]` and `test_train_moe_with_peft_config` with a target set); the run now plans and trains."""

import math

import pytest
import torch

pytest.importorskip("trl")

from transformers import GptOssConfig, GptOssForCausalLM, MixtralConfig, MixtralForCausalLM  # noqa: E402

from hf_accum import tiny  # noqa: E402
from hf_accum.trl import AccumSFTConfig, AccumSFTTrainer  # noqa: E402
from tests.integrations.test_router_aux import _sft_data, tiny_moe  # noqa: E402

ARGS = dict(per_device_train_batch_size=2, max_steps=1, logging_steps=1, report_to=[], save_strategy="no",
            use_cpu=True, bf16=False, seed=0, disable_tqdm=True, max_length=64, gradient_checkpointing=False,
            memory_budget_bytes=1 << 30, probe_max_micro_batch=2)


def _mixtral(tok):
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))


def _gpt_oss(tok):
    torch.manual_seed(0)
    return GptOssForCausalLM(GptOssConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))


@pytest.mark.parametrize("build", [tiny_moe, _mixtral, _gpt_oss], ids=["qwen3_moe", "mixtral", "gpt_oss"])
def test_an_moe_model_plans_trains_and_evaluates_with_a_target(tmp_path, build):
    tok = tiny.build_tokenizer()
    data = _sft_data()
    args = AccumSFTConfig(output_dir=str(tmp_path), target_batch_size=4, eval_strategy="steps", eval_steps=1,
                          per_device_eval_batch_size=2, **ARGS)
    trainer = AccumSFTTrainer(model=build(tok), args=args, train_dataset=data, eval_dataset=data.select(range(4)),
                              processing_class=tok)
    assert trainer.aux_loss_enabled  # TRL adds the router term: the path that read the missing attribute
    trainer.evaluate()  # before training: compute_loss outside the loop (the eval-batch measurement too)
    trainer.train()
    assert trainer.plan.target_batch_size == 4 and trainer.probe_result is not None
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])
    assert any("eval_loss" in h for h in trainer.state.log_history)


def test_an_moe_model_with_a_peft_config_plans_and_trains_with_a_target(tmp_path):
    peft = pytest.importorskip("peft")
    tok = tiny.build_tokenizer()
    args = AccumSFTConfig(output_dir=str(tmp_path), target_batch_size=4, **ARGS)
    trainer = AccumSFTTrainer(model=tiny_moe(tok), args=args, train_dataset=_sft_data(), processing_class=tok,
                              peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    assert trainer.plan.target_batch_size == 4 and trainer.probe_result is not None
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])
