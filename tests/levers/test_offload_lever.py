"""Activation offload as a lever (hf_accum/levers/offload.py): absent on CPU, which the probe log says in one line;
a pin refused there; on CUDA a pin is applied after the checkpointed layers and recorded."""

import logging

import pytest

from hf_accum import AccumTrainingArguments
from hf_accum.levers import activation_offload as offload
from hf_accum.levers import get_lever, searched
from hf_accum.tiny import build_model
from tests.conftest import sft_trainer

MiB = 2**20
ABSENT = ("hf_accum: activation offload skipped: the model is on cpu, where activations already live in host memory "
          "(the lever is CUDA only)")


def make(tmp_path, tok, **kw):
    defaults = dict(output_dir=str(tmp_path), target_batch_size=8, memory_budget_bytes=9 * MiB, use_cpu=True,
                    report_to=[], max_steps=1, save_strategy="no", disable_tqdm=True, probe_seq_len=64)
    return sft_trainer(tok, build_model(tokenizer=tok, num_layers=3), **{**defaults, **kw})


def test_on_cpu_the_probe_log_says_in_one_line_that_offload_is_absent(tmp_path, tok, caplog):
    trainer = make(tmp_path, tok)
    with caplog.at_level(logging.INFO, logger="hf_accum"):
        plan = trainer.tune()
    lines = [r.getMessage() for r in caplog.records if "offload" in r.getMessage()]
    assert lines == [ABSENT]
    assert "offload" not in (plan.levers or {})


def test_a_pin_on_cpu_is_refused_at_construction(tmp_path, tok):
    with pytest.raises(ValueError, match=r"levers: offload=1, but activation offload skipped: the model is on cpu"):
        make(tmp_path, tok, levers="offload=1")
    make(tmp_path, tok, levers="offload=off")  # off is fine anywhere


@pytest.mark.parametrize("value", ["x", "-1", "1.5"])
def test_a_bad_pin_is_refused(value):
    with pytest.raises(ValueError, match=f"levers: offload='{value}' must be 'auto', 'off'"):
        AccumTrainingArguments(output_dir="unused", use_cpu=True, report_to=[], levers=f"offload={value}")


def test_the_record_words():
    lever = get_lever("offload")
    assert lever.describe({"layers": 2, "of": 4, "pinned": True}) == "offload 2 of 4 layers (as set)"
    assert lever.figures({"layers": 2, "of": 4}) == {"hf_accum/offloaded_layers": 2}


@pytest.mark.gpu
def test_a_pin_on_cuda_offloads_after_the_checkpointed_layers_and_is_recorded(tmp_path, tok):
    trainer = make(tmp_path, tok, use_cpu=False, levers="checkpointing=1,offload=2", memory_budget_bytes=None)
    assert searched(trainer) is None  # checkpointing pinned: nothing searched
    plan = trainer.tune()
    assert plan.levers["offload"] == {"layers": 2, "of": 3, "pinned": True}
    assert offload.offloaded_indices(trainer.model) == [1, 2]
    trainer.train()
    assert trainer.state.global_step == 1
