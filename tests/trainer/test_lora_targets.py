"""A LoRA `target_modules` list whose names match only partly is refused, naming the unmatched name and the model's
linear layers: peft trains the matched names alone without a word (issue 42, item 6). From the recipe CLI, and from
Python through `AccumTrainer` with a PEFT model and through a TRL trainer with a `peft_config`."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_accum import AccumTrainer, AccumTrainingArguments, tiny
from hf_accum.cli import main
from tests.exactness import lm_examples, pad_collate, tiny_llama

LLAMA_LINEARS = "down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"


def args_for(tmp_path):
    return AccumTrainingArguments(output_dir=str(tmp_path / "out"), target_batch_size=4, auto_tune=False,
                                  per_device_train_batch_size=2, gradient_accumulation_steps=2, use_cpu=True,
                                  report_to=[], save_strategy="no")


def test_a_peft_model_with_a_target_that_matched_nothing_is_refused(tmp_path):
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "nonexistent_mod"]))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) > 0  # peft said nothing: q_proj alone
    with pytest.raises(ValueError) as info:
        AccumTrainer(model=model, args=args_for(tmp_path), train_dataset=lm_examples(8), data_collator=pad_collate)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("LoRA target_modules lists 'nonexistent_mod', which matches no module of LlamaForCausalLM")
    assert f"Its linear layers: {LLAMA_LINEARS}." in message


def test_targets_that_all_match_are_accepted(tmp_path):
    for targets in (["q_proj", "v_proj"], "all-linear", ["self_attn.q_proj"]):
        model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=targets))
        AccumTrainer(model=model, args=args_for(tmp_path), train_dataset=lm_examples(8), data_collator=pad_collate)


def test_a_trl_trainer_given_a_peft_config_with_an_unmatched_target_is_refused(tmp_path):
    from datasets import Dataset

    from hf_accum.trl import AccumSFTConfig, AccumSFTTrainer

    tok = tiny.build_tokenizer()
    data = Dataset.from_list([{"prompt": r["prompt"], "completion": r["response"]}
                              for r in tiny.generate_instruction_data(8, seed=1)])
    model = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float32, hidden_size=32)
    args = AccumSFTConfig(output_dir=str(tmp_path / "out"), target_batch_size=4, use_cpu=True, bf16=False,
                          report_to=[], save_strategy="no", max_length=64)
    with pytest.raises(ValueError, match=r"^LoRA target_modules lists 'nonexistent_mod', which matches no module .*"
                                         r"Its linear layers: .*q_proj"):
        AccumSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                        peft_config=LoraConfig(r=4, target_modules=["q_proj", "nonexistent_mod"]))


def test_the_recipe_cli_refuses_a_partly_matching_target_list(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "lora_sft", "lora.target_modules=[q_proj,nonexistent_mod]", "max_steps=1",
                 f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "lora.target_modules=['q_proj', 'nonexistent_mod'] does not fit 'tiny'" in err[0]
    assert "lists 'nonexistent_mod', which matches no module" in err[0] and "q_proj" in err[0]
    assert not (out / "checkpoint-1").exists()
