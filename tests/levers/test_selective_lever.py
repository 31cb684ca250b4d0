"""Selective checkpointing as a lever (hf_accum/levers/selective.py), through the trainer: exact in float64 with
dropout against no checkpointing (LM, LoRA, padding-free), chosen by the probe when only the selective or full
levels fit (no checkpointing flag from the user, a simulated meter), pinned with levers="selective=S"."""

import logging

import pytest
import torch
from transformers import DataCollatorWithFlattening

from hf_accum import AccumTrainer, AccumTrainingArguments
from hf_accum.compat import gradient_checkpointing
from hf_accum.levers import checkpointing, searched, selective
from hf_accum.planning import tuning
from hf_accum.probing.meters import Measurement, Meter
from hf_accum.tiny import SFTCollator, build_model, build_sft_dataset, build_tokenizer
from tests.exactness import lm_examples, pad_collate
from tests.levers.test_checkpoint_layers import LAYERS, dropout_llama, lora_llama, rel_error

MiB = 2**20


# --- the chain ------------------------------------------------------------------------------------------------------
def test_the_chain_of_per_layer_states():
    assert [selective.split(p, 3) for p in range(7)] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 2), (2, 1), (3, 0)]
    levels = selective.Levels(dropout_llama(), LAYERS, {})
    assert (levels.count, levels.anchors) == (2 * LAYERS, (0, LAYERS, 2 * LAYERS))
    assert levels.record(LAYERS + 1) == {"full": 1, "selective": LAYERS - 1, "of": LAYERS}
    with pytest.raises(ValueError, match="outside"):
        selective.split(2 * LAYERS + 1, LAYERS)
    with levels.at(LAYERS + 1):
        assert (gradient_checkpointing.checkpointed_count(levels.model), selective.selective_count(levels.model)) == (
            LAYERS, LAYERS - 1)
    assert gradient_checkpointing.checkpointed_count(levels.model) == 0


# --- exact through the trainer --------------------------------------------------------------------------------------
class Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def flat_collate(rows):
    return DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": r["input_ids"]} for r in rows])


def updated(build, collate, tmp_path, seed=3, **kw):
    """The weights after one SGD step (lr 1: minus the gradient) of 6 sequences in one batch, float64, dropout on."""
    torch.manual_seed(0)
    model = build().double()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    args = AccumTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, save_strategy="no",
                                  disable_tqdm=True, per_device_train_batch_size=6, gradient_accumulation_steps=1,
                                  learning_rate=1.0, optim="sgd", max_grad_norm=0.0, lr_scheduler_type="constant",
                                  remove_unused_columns=False, seed=seed, auto_tune=False, **kw)
    trainer = AccumTrainer(model=model, args=args, train_dataset=Rows(lm_examples(6, seed=5)), data_collator=collate)
    trainer.train()
    state = (gradient_checkpointing.checkpointed_count(model), selective.selective_count(model))
    return {n: before[n] - p.detach() for n, p in model.named_parameters() if n in before}, state


@pytest.mark.parametrize("build, collate", [(dropout_llama, pad_collate), (lora_llama, pad_collate),
                                            (dropout_llama, flat_collate)], ids=["lm", "lora", "padding_free"])
def test_selective_layers_train_exactly_as_none(build, collate, tmp_path):
    want, state = updated(build, collate, tmp_path / "none", gradient_checkpointing=False)
    assert state == (0, 0)
    other_seed, _ = updated(build, collate, tmp_path / "seed", seed=4, gradient_checkpointing=False)
    assert rel_error(other_seed, want) > 1e-3  # dropout really is on: another seed differs
    got, state = updated(build, collate, tmp_path / "sel", levers="checkpointing=1,selective=2")
    assert state == (3, 2)  # 1 full + 2 selective of 3: the pins were trained at
    assert rel_error(got, want) <= 1e-12
    assert max(float(v.abs().max()) for v in want.values()) > 0


# --- chosen by measurement --------------------------------------------------------------------------------------
def simulated_meter(model):
    """Memory and time read from the model's per-layer states: a layer holds 8 units of activations per row without
    checkpointing, 5 selectively, 1 fully; recompute costs 0.2 (selective) or 1.0 (full) units of time per row."""
    layers = gradient_checkpointing.checkpointable_layers(model)

    def state():
        sel = selective.selective_count(model)
        full = gradient_checkpointing.checkpointed_count(model) - sel
        return full, sel, len(layers) - full - sel

    class SimulatedMeter(Meter):
        name = "simulated"

        def measure(self, fn, *, micro_batch_size=None):
            fn()
            full, sel, none = state()
            peak = MiB * (10 + micro_batch_size * (8 * none + 5 * sel + 1 * full))
            return Measurement(int(peak), None, self.time(lambda: None, micro_batch_size=micro_batch_size))

        def time(self, fn, *, micro_batch_size=None):
            fn()
            full, sel, _ = state()
            return 0.01 + micro_batch_size * (1.0 + 0.2 * sel + 1.0 * full) * 1e-3

        def capacity_bytes(self):
            return 2**40

    return SimulatedMeter()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def make(tmp_path, tok, budget_mib, **kw):
    args = AccumTrainingArguments(output_dir=str(tmp_path), target_batch_size=8, memory_budget_bytes=budget_mib * MiB,
                                  use_cpu=True, report_to=[], max_steps=1, save_strategy="no", disable_tqdm=True,
                                  probe_seq_len=64, **kw)
    model = build_model(tokenizer=tok, num_layers=LAYERS)
    return AccumTrainer(model=model, args=args, train_dataset=build_sft_dataset(16, tok), data_collator=SFTCollator(tok))


def test_a_budget_only_selective_or_full_fits_trains_without_any_flag(tmp_path, tok, monkeypatch, caplog):
    # per row (3 layers), no checkpointing: 24 MiB (10 + 24 > the 30 MiB budget); all selective: 15 (1 row); all full:
    # 3 (6 rows)
    trainer = make(tmp_path, tok, 30)
    monkeypatch.setattr(tuning, "default_meter", simulated_meter)
    assert trainer.args.checkpoint_layers == "auto" and searched(trainer).name == "selective"
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer.train()
    record = trainer.plan.levers["selective"]
    assert record["full"] + record["selective"] >= 1 and record["of"] == LAYERS
    assert {t.checkpointed_layers for t in trainer.probe_result.trials} >= {0, LAYERS}  # none, all selective
    assert not any(t.fits for t in trainer.probe_result.trials if t.checkpointed_layers == 0)
    assert gradient_checkpointing.checkpointed_count(trainer.model) == record["full"] + record["selective"]
    assert selective.selective_count(trainer.model) == record["selective"]
    assert f"checkpointing {record['full']} full + {record['selective']} selective of {LAYERS} layers" in caplog.text
    assert trainer.state.global_step == 1
    predicted = 10 + trainer.plan.micro_batch_size * (5 * record["selective"] + record["full"]
                                                      + 8 * (LAYERS - record["full"] - record["selective"]))
    assert predicted <= 30  # the chosen point fits by the simulated meter's own formula


def test_selective_is_chosen_where_it_is_the_fastest_fit(tmp_path, tok, monkeypatch):
    # all selective fits the whole window of 8 (10 + 8 * 15 = 130 MiB <= 175), none 6 rows (2 forwards): one forward,
    # at the fewest selective layers that hold it (10 + 8 * (8 * (3 - s) + 5 * s) <= 175: s = 2), and no full layer
    trainer = make(tmp_path, tok, 175)
    monkeypatch.setattr(tuning, "default_meter", simulated_meter)
    plan = trainer.tune()
    fewest = min(s for s in range(LAYERS + 1) if 10 + 8 * (8 * (LAYERS - s) + 5 * s) <= 175)
    assert plan.levers["selective"] == {"full": 0, "selective": fewest, "of": LAYERS} and fewest == 2
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (8, 1)
    assert LAYERS * 2 not in {t.checkpointed_layers for t in trainer.probe_result.trials}  # all full never measured


# --- pinning ------------------------------------------------------------------------------------------------------
def test_a_pin_is_obeyed_and_recorded(tmp_path, tok, caplog):
    trainer = make(tmp_path, tok, 30, levers="selective=3")
    assert searched(trainer) is None  # pinned: no level search, checkpointing included
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        plan = trainer.tune()
    assert {k: v for k, v in plan.levers.items() if k != "loss_kernel"} == {
        "selective": {"full": 0, "selective": 3, "of": LAYERS, "pinned": True}}
    assert selective.selective_count(trainer.model) == 3
    assert f"checkpointing 0 full + 3 selective of {LAYERS} layers (as set)" in caplog.text


def test_off_leaves_the_search_to_checkpointing(tmp_path, tok):
    trainer = make(tmp_path, tok, 30, levers="selective=off")
    assert searched(trainer).name == "checkpointing"
    assert searched(make(tmp_path, tok, 30, gradient_checkpointing=False)) is None  # an explicit flag is obeyed


@pytest.mark.parametrize("kw,message", [
    ({"levers": "selective=4"}, "pin at most 3 selective layers"),
    ({"levers": "selective=2,checkpointing=2"}, "pin at most 1 selective layers"),
    ({"levers": "selective=2", "gradient_checkpointing": True}, "contradict each other"),
    ({"levers": "selective=2", "gradient_checkpointing_kwargs": {"use_reentrant": True}}, "use_reentrant=True"),
    ({"levers": "selective=two"}, "levers: selective='two' must be 'auto', 'off'"),
])
def test_a_pin_the_model_cannot_take_is_refused_at_construction(tmp_path, tok, kw, message):
    with pytest.raises(ValueError, match=message):
        make(tmp_path, tok, 30, **kw)


def test_reentrant_kwargs_leave_the_search_to_checkpointing(tmp_path, tok):
    trainer = make(tmp_path, tok, 30, gradient_checkpointing_kwargs={"use_reentrant": True})
    assert searched(trainer).name == checkpointing.NAME
