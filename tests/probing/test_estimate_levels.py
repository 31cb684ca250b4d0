"""The levers on paper: each checkpointing level its estimated peak (like for like with the CPU probe), the level
search run on paper (``checkpoint_layers="auto"``), and the real level search seeded from it: each anchor's search
starts at the estimate's largest fit there, and the plan is the unseeded search's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_accum.compat import gradient_checkpointing as gc
from hf_accum.levers import checkpointing, selective
from hf_accum.probing.estimate import estimate_model
from hf_accum.probing.estimate_check import against_probe
from hf_accum.probing.meters import CpuMeter
from hf_accum.probing.paper import with_lora
from hf_accum.probing.probe import probe_model
from hf_accum.probing.seed import probe_with_estimate

MiB = 2**20


def _config(arch: str):
    from transformers import LlamaConfig, Qwen2Config

    if arch == "llama":
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    return Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _builder(arch: str, lora: bool = False):
    from transformers import AutoModelForCausalLM

    config = _config(arch)
    build = lambda: AutoModelForCausalLM.from_config(config)  # noqa: E731
    return with_lora(build, 8, None) if lora else build


@pytest.mark.parametrize("arch, lora, level", [
    ("llama", False, 1), ("llama", False, "all"), ("llama", True, 1), ("llama", True, "all"),
    ("qwen2", False, "all"), ("qwen2", True, 1),
])
def test_a_checkpointed_estimate_is_within_5_percent_of_the_cpu_probe(arch, lora, level):
    rows, measured_max, estimated_max, est = against_probe(_builder(arch, lora), seq_len=128, target_batch_size=16,
                                                           budget_bytes=12 * MiB, checkpoint_layers=level, all_peaks=False)
    assert len(rows) >= 2
    for row in rows:
        assert abs(row.error) <= 0.05, (arch, lora, level, row)
    assert estimated_max == measured_max and 1 <= measured_max < 16
    assert est.checkpointed_layers == (2 if level == "all" else level)
    assert est.plan.levers is None  # a level set before the search is not a choice of it


def test_auto_gives_each_level_its_peaks_and_takes_the_fewest_layers_for_the_fewest_forwards():
    build = _builder("llama")
    common = dict(seq_len=128, target_batch_size=16, device="cpu", device_memory=64 * 2**30, budget_bytes=8 * MiB)
    auto = estimate_model(build, checkpoint_layers="auto", **common)
    plain = estimate_model(build, **common)
    full = estimate_model(build, checkpoint_layers="all", **common)
    assert set(auto.level_peaks) == {0, 2}  # the anchors: none, then every layer (none did not hold the window)
    for k, pinned in ((0, plain), (2, full)):  # each level's peaks are that level's own estimate
        shared = set(auto.level_peaks[k]) & set(pinned.peaks)
        assert shared and all(auto.level_peaks[k][m] == pinned.peaks[m] for m in shared)
    assert plain.result.max_micro_batch_size < full.result.max_micro_batch_size  # checkpointing frees memory
    # no step times on paper: the fewest forwards per optimizer step, then the fewest checkpointed layers
    fits = {k: max(m for m, v in peaks.items() if v <= common["budget_bytes"]) for k, peaks in auto.level_peaks.items()}
    forwards = {k: -(-16 // fit) for k, fit in fits.items()}
    best = min(forwards.values())
    assert auto.checkpointed_layers == min(k for k, f in forwards.items() if f == best) == 2
    assert auto.plan.levers == {"checkpointing": {"layers": 2, "of": 2}}
    assert auto.plan.micro_batch_size == -(-16 // best) and auto.plan.step_seconds is None
    assert auto.peaks == auto.level_peaks[2]
    assert auto.to_json()["level_peaks"]["2"] == {str(m): v for m, v in auto.level_peaks[2].items()}


def test_auto_stops_at_none_when_the_window_fits_without_checkpointing():
    est = estimate_model(_builder("llama"), seq_len=32, target_batch_size=2, device="cpu", device_memory=64 * 2**30,
                         budget_bytes=64 * MiB, checkpoint_layers="auto")
    assert est.checkpointed_layers == 0 and set(est.level_peaks) == {0}
    assert est.plan.micro_batch_size == 2 and est.plan.levers == {"checkpointing": {"layers": 0, "of": 2}}


@pytest.mark.parametrize("value, words", [
    ("some", "checkpoint_layers='some'"), (-1, "checkpoint_layers=-1"), (True, "checkpoint_layers=True"),
    (3, "has 2 checkpointable layers"),
])
def test_a_checkpoint_layers_it_cannot_take_is_refused_in_one_line(value, words):
    with pytest.raises(ValueError, match="checkpoint_layers") as info:
        estimate_model(_builder("llama"), seq_len=16, target_batch_size=2, device="cpu", device_memory=2**30,
                       checkpoint_layers=value)
    assert words in str(info.value) and "\n" not in str(info.value)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    _config("llama").save_pretrained(folder)  # config.json only
    return str(folder)


@pytest.mark.parametrize("flags, level", [(["--gradient-checkpointing"], 2), (["--checkpoint-layers", "1"], 1),
                                          (["--checkpoint-layers", "auto"], 2)])
def test_cli_estimate_with_checkpointing(llama_folder, tmp_path, capsys, flags, level):
    import json

    from hf_accum.cli import main

    out = tmp_path / "plan.json"
    code = main(["probe", "--estimate", "--model", llama_folder, "--device", "cpu", "--device-memory", "1GiB",
                 "--budget-bytes", str(8 * MiB), "--seq-len", "128", "--target-batch", "16", "--no-fused-loss",
                 "--json", str(out), *flags])
    printed = capsys.readouterr().out
    assert code == 0
    data = json.loads(out.read_text())
    assert data["checkpointed_layers"] == level and str(level) in data["level_peaks"]
    assert f"checkpointing {level} layers (the plan's): 1: " in printed
    if flags[-1] == "auto":  # both anchors, each its own line
        assert "checkpointing 0 layers: 1: " in printed and data["levers"]["checkpointing"]["layers"] == 2


# --- the real level search seeded from the estimate --------------------------------------------------------------
def _recompute_seconds(model):
    """A step's seconds as a formula of its rows and the layers recomputing (full 0.3, selective 0.07 of a layer's
    forward per row, plus a fixed cost per forward): the chooser's input made deterministic, so two searches that
    measure the same memory choose the same plan (CPU step times on a shared machine are noise)."""
    selective_layers = selective.selective_count(model)
    full_layers = gc.checkpointed_count(model) - selective_layers

    def seconds(micro: int) -> float:
        return (1.0 + 0.1 * micro * (1.0 + 0.3 * full_layers + 0.07 * selective_layers)) / 100

    return seconds


@pytest.fixture
def formula_times(monkeypatch):
    """The CPU meter's peaks as measured, its seconds `_recompute_seconds` of the model appended to the list."""
    models = []
    real_measure = CpuMeter.measure

    def measure(self, fn, *, micro_batch_size=None):
        m = real_measure(self, fn, micro_batch_size=micro_batch_size)
        return dataclasses.replace(m, seconds=_recompute_seconds(models[-1])(micro_batch_size or 1))

    def timed(self, fn, *, micro_batch_size=None):
        fn()
        return _recompute_seconds(models[-1])(micro_batch_size or 1)

    monkeypatch.setattr(CpuMeter, "measure", measure)
    monkeypatch.setattr(CpuMeter, "time", timed)
    return models


def _per_anchor(result) -> dict[int, int]:
    counts: dict[int, int] = {}
    for t in result.trials:
        counts[t.checkpointed_layers] = counts.get(t.checkpointed_layers, 0) + 1
    return counts


def _levels(result):
    return [(lv["k"], lv["largest_fit"]) for lv in result.extra["checkpointing"]["levels"]]


@pytest.mark.parametrize("lever_module", [checkpointing, selective], ids=["checkpointing", "selective"])
def test_the_level_search_starts_at_the_estimate_and_plans_as_the_unseeded_one(lever_module, formula_times):
    torch.manual_seed(0)
    model = _builder("llama")()
    formula_times.append(model)
    lever = lambda: lever_module.Levels(model, 2, {"use_reentrant": False})  # noqa: E731
    probe = dict(seq_len=128, target_batch_size=16, budget_bytes=8 * MiB)
    plain, plain_plan = probe_model(model, lever=lever(), **probe)
    said = []
    seeded, plan = probe_with_estimate(model, lever=lever(), log=said.append, **probe)
    assert plan == plain_plan and _levels(seeded) == _levels(plain)
    assert plan.levers[lever_module.NAME] != lever().record(0)  # checkpointing chosen: the searches went past none
    anchors = lever().anchors
    per_anchor = _per_anchor(seeded)
    assert set(per_anchor) == set(anchors) and sum(per_anchor.values()) / len(anchors) <= 2, seeded.trials
    assert sum(per_anchor.values()) <= sum(_per_anchor(plain).values())
    estimate = seeded.extra["estimate"]
    assert {int(k): fit for k, fit in estimate["levels"].items()} == dict(_levels(seeded))  # the estimate was right
    for t in seeded.trials:  # each anchor's first trial is the estimate's largest fit there
        first = next(u for u in seeded.trials if u.checkpointed_layers == t.checkpointed_layers)
        assert first.micro_batch_size == estimate["levels"][str(t.checkpointed_layers)]
    measured = {(t.checkpointed_layers, t.micro_batch_size): t.peak_bytes for t in seeded.trials}
    for k, peaks in estimate["level_peaks"].items():  # the record: each level's peaks, within 5% where measured
        for micro, predicted in peaks.items():
            if (int(k), int(micro)) in measured:
                assert abs(predicted / measured[int(k), int(micro)] - 1) <= 0.05
    assert any(line.startswith("estimate (cpu, fake tensors") and f"largest fit per {lever_module.NAME} level"
               in line for line in said), said


def test_a_lever_whose_levels_cannot_be_set_on_paper_searches_as_before():
    from types import SimpleNamespace

    from hf_accum.probing.seed import lever_reason

    assert lever_reason(None) is None
    assert lever_reason(checkpointing.Levels(None, 2, {})) is None
    assert lever_reason(SimpleNamespace(name="offload")) == (
        "the offload lever's levels cannot be set on the estimate's model")


def _tiny_trainer(tmp_path, from_estimate: bool, models: list):
    from hf_accum import AccumTrainer, AccumTrainingArguments
    from hf_accum.tiny import SFTCollator, build_model, build_sft_dataset, build_tokenizer

    tok = build_tokenizer()
    args = AccumTrainingArguments(output_dir=str(tmp_path), target_batch_size=16, memory_budget_bytes=5 * MiB,
                                  use_cpu=True, report_to=[], max_steps=1, save_strategy="no", disable_tqdm=True,
                                  fused_loss=False, probe_from_estimate=from_estimate)  # checkpoint_layers: "auto"
    model = build_model(tokenizer=tok)
    models.append(model)
    return AccumTrainer(model=model, args=args, train_dataset=build_sft_dataset(48, tok),
                        data_collator=SFTCollator(tok))


def test_the_trainers_default_level_search_is_seeded_and_plans_as_the_unseeded_one(tmp_path, formula_times):
    """The trainer's default (checkpoint_layers "auto": the selective chain's anchors none, all selective, all full)
    starts each anchor at the estimate: <= 2 trials per searched anchor on average, the unseeded plan."""
    models = formula_times
    runs = {}
    for from_estimate in (False, True):
        trainer = _tiny_trainer(tmp_path / str(from_estimate), from_estimate, models)
        plan = trainer.tune()
        runs[from_estimate] = (plan, trainer.probe_result)
    (plain_plan, plain), (plan, seeded) = runs[False], runs[True]
    assert plan == plain_plan and _levels(seeded) == _levels(plain)
    assert "estimate" in seeded.extra and "estimate" not in plain.extra
    per_anchor = _per_anchor(seeded)
    assert len(per_anchor) >= 2, seeded.trials  # the search went past "none"
    assert sum(per_anchor.values()) / len(per_anchor) <= 2, seeded.trials
    assert sum(per_anchor.values()) <= sum(_per_anchor(plain).values())


# --- the recipes' default probe (checkpoint_layers "auto": their gradient_checkpointing pin removed) ----------------
@pytest.mark.parametrize("recipe", ["lora_sft", "qlora_sft"])
def test_the_recipes_default_probe_is_seeded_and_plans_as_the_unseeded_one(recipe, formula_times, monkeypatch):
    from hf_accum.planning import tuning
    from hf_accum.recipes.run import probe_recipe

    for name in ("probe_model", "probe_with_estimate"):  # the model each probe measures: the formula's input
        real = getattr(tuning, name)
        monkeypatch.setattr(tuning, name, lambda model, *a, _real=real, **k: (formula_times.append(model),
                                                                                _real(model, *a, **k))[1])
    auto = ["gradient_checkpointing=false", "checkpoint_layers=auto"]
    seeded = probe_recipe(recipe, auto, say=lambda _line: None)
    assert "estimate" in seeded.result.extra  # the estimate seeded it: TRL's fused LM head (and NF4) on paper
    plain = probe_recipe(recipe, [*auto, "probe_from_estimate=false"], say=lambda _line: None)
    assert seeded.plan == plain.plan and _levels(seeded.result) == _levels(plain.result)
    per_anchor = _per_anchor(seeded.result)
    assert sum(per_anchor.values()) / len(per_anchor) <= 2, seeded.result.trials
