"""`hf_accum.estimate(..., gpus=..., sharding=...)` and `hf-accum probe --estimate --gpus`: every cell's answer is the
edge of the sizes it stepped (the largest fitting and the one above it measured), LoRA's frozen base holds no
gradient or optimizer state, the JSON carries the cells and the per-rank bytes, and flags that do not belong are
refused in one line."""

import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_accum
from hf_accum.probing.sharding import rank_peak, shard


def _config():
    return LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def _build():
    return LlamaForCausalLM(_config())


def test_every_cell_is_the_edge_of_the_sizes_it_stepped():
    cards = [6 * 2**20, 12 * 2**20]
    est = hf_accum.estimate(_build, seq_len=64, target_batch_size=16, device="cpu", device_memory=cards,
                            gpus=[1, 2, 4], sharding="zero3", budget_fraction=1.0)
    assert len(est.cells) == 6 and any(c.fits for c in est.cells)
    for cell in est.cells:
        acts = est.activations[64, None if cell.checkpointing in (None, "none") else "all"]
        opt = est.optimizer[64, None if cell.checkpointing in (None, "none") else "all"]

        def peak(m, cell=cell, acts=acts, opt=opt):
            return rank_peak(est.counts, est.sharding, cell.gpus, acts[m], opt)

        if not cell.fits:
            assert peak(1) > cell.card_bytes
            continue
        cap = 16 // cell.gpus
        assert peak(cell.micro_batch) <= cell.card_bytes and cell.peak_bytes == peak(cell.micro_batch)
        assert cell.micro_batch == cap or peak(cell.micro_batch + 1) > cell.card_bytes
        assert cell.plan.endswith(f"× {cell.gpus} = 16")
    doc = json.loads(json.dumps(est.to_json()))
    assert doc["sharded"] and len(doc["cells"]) == 6 and set(doc["rank_bytes"]) == {"1", "2", "4"}


def test_one_model_on_paper_serves_every_length_and_level_in_any_order():
    """The grid builds its model once (each build of an 8B model costs seconds): a level is set for its steps and
    undone after, so what a step measures does not depend on the steps before it; each answer equals a model built
    for that length and level alone (`Phases`)."""
    from hf_accum.probing.paper_sharded import FakeSteps, Phases

    built = []

    def build():
        built.append(1)
        return _build()

    asked = [(64, "all", 2), (128, None, 1), (64, None, 2), (128, "all", 3), (64, "all", 1), (64, None, 3)]
    with FakeSteps(build, seq_lens=[64, 128], device="cpu", bf16=False) as steps:
        got = {a: steps.activations(*a) for a in asked}
        again = {a: steps.activations(*a) for a in reversed(asked)}  # each answered from what was stepped
        optimizer = steps.optimizer
    assert len(built) == 1 and got == again
    for seq, level, micro in asked:
        with Phases(_build, seq_len=seq, device="cpu", bf16=False, checkpoint_layers=level) as alone:
            assert alone.activations(micro) == got[seq, level, micro], (seq, level, micro)
            assert alone.optimizer == optimizer
    assert got[64, "all", 2] < got[64, None, 2]  # checkpointing was on for the one and off for the other


def test_lora_sharded_counts_gradients_and_optimizer_state_of_the_adapters_alone():
    from peft import LoraConfig, get_peft_model

    est = hf_accum.estimate(_build, seq_len=32, target_batch_size=8, device="cpu", device_memory=2**30, gpus=[2],
                            sharding="fsdp2", lora_r=4)
    with torch.device("meta"):  # an independent count: the adapters peft adds, nothing else trainable
        model = get_peft_model(_build(), LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    assert adapters and all(p.requires_grad for p in adapters)
    doc = est.to_json()["rank_bytes"]["2"]
    assert doc["gradients"] == sum(-(-p.shape[0] // 2) * p[0].numel() * 4 for p in adapters)
    assert doc["optimizer"] == 2 * doc["gradients"]
    assert doc["weights"] == shard(est.counts.params, 2) > doc["gradients"]


def test_the_cli_prints_a_table_per_card_and_refuses_gpus_without_estimate(tmp_path, capsys):
    from hf_accum.cli import main

    _config().save_pretrained(tmp_path / "m")
    out = tmp_path / "g.json"
    assert main(["probe", "--estimate", "--model", str(tmp_path / "m"), "--device", "cpu", "--gpus", "1,2",
                 "--sharding", "zero2+offload", "--device-memory", "8MiB,64MiB", "--seq-len", "32",
                 "--target-batch", "8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "**8 MiB per GPU**" in text and "**64 MiB per GPU**" in text and "| 32 |" in text
    assert "ZeRO-2 + optimizer offload: DeepSpeed cannot run on fake tensors" in text
    assert json.loads(out.read_text())["sharding"] == "ZeRO-2 + optimizer offload"
    assert main(["probe", "--model", str(tmp_path / "m"), "--gpus", "2"]) == 2
    assert "--gpus is for --estimate" in capsys.readouterr().err
    assert main(["probe", "--estimate", "--model", str(tmp_path / "m"), "--gpus", "2", "--sharding", "ddp",
                 "--device-memory", "1GiB"]) == 2
    assert "sharding='ddp': give one of fsdp2, zero1" in capsys.readouterr().err
