"""Levers as plug-ins (hf_accum/levers/): the registry, the plan's one record per lever (old plan files still load),
levels the user set recorded in the plan and its line, pins through ``levers="name=value"``, and the one check of
``checkpoint_layers``."""

import contextlib
import json
import logging

import pytest

from hf_accum import AccumTrainingArguments
from hf_accum.compat import gradient_checkpointing
from hf_accum.levers import base, checkpointing, get_lever, registered, searched
from hf_accum.planning.store import PLAN_FILE, PlanFileError, plan_from_record, read_plan_file
from hf_accum.probing.plan import Plan
from hf_accum.tiny import build_model
from tests.conftest import sft_trainer

MiB = 2**20
LAYERS = 4


def layer_levers(plan):
    """The plan's layer levers; the loss kernel's record (levers/kernels/lever.py, measured times) checked apart."""
    levers = dict(plan.levers or {})
    kernel = levers.pop("loss_kernel", None)
    assert kernel is None or kernel["kernel"] in ("torch", "chunked")
    return levers


def make(tmp_path, tok, **kw):
    defaults = dict(output_dir=str(tmp_path), target_batch_size=16, memory_budget_bytes=9 * MiB, use_cpu=True,
                    report_to=[], max_steps=1, save_strategy="no", disable_tqdm=True, probe_seq_len=128)
    return sft_trainer(tok, build_model(tokenizer=tok, num_layers=LAYERS), **{**defaults, **kw})


# --- the plan's records -----------------------------------------------------------------------------------------
def test_an_old_plan_file_with_checkpointed_layers_loads_as_the_lever_record(tmp_path):
    old = {"plan": {"micro_batch_size": 2, "gradient_accumulation_steps": 4, "world_size": 1, "target_batch_size": 8,
                    "checkpointed_layers": 3, "num_layers": 4, "step_seconds": 0.5}, "key": {}, "probe": None}
    (tmp_path / PLAN_FILE).write_text(json.dumps(old))
    plan, _ = read_plan_file(str(tmp_path))
    assert plan.levers == {"checkpointing": {"layers": 3, "of": 4}}
    assert (plan.checkpointed_layers, plan.num_layers, plan.step_seconds) == (3, 4, 0.5)
    assert plan.describe().endswith("; checkpointing 3 of 4 layers")
    assert plan.to_dict()["levers"] == {"checkpointing": {"layers": 3, "of": 4}} and "checkpointed_layers" not in \
        plan.to_dict()
    with pytest.raises(PlanFileError, match="levers"):  # an old file's impossible level is still refused
        plan_from_record({"plan": {**old["plan"], "checkpointed_layers": 5}}, "x.json")


def test_a_new_plan_file_round_trips_every_record():
    plan = Plan(2, 4, 1, 8, levers={"checkpointing": {"layers": 2, "of": 4}})
    assert plan_from_record({"plan": json.loads(json.dumps(plan.to_dict()))}, "x.json") == plan


@pytest.mark.parametrize("record", [{"layers": 5, "of": 4}, {"layers": -1, "of": 4}, {"of": 4}, {"layers": 1},
                                    {"layers": 1, "of": 0}, {"full": 2, "selective": 3, "of": 4}, "2"])
def test_an_impossible_record_is_refused(record):
    with pytest.raises(ValueError, match="inconsistent plan: levers"):
        Plan(2, 4, 1, 8, levers={"checkpointing": record})


def test_a_pinned_record_reads_as_not_chosen():
    plan = Plan(2, 4, 1, 8, levers={"checkpointing": {"layers": 4, "of": 4, "pinned": True}})
    assert plan.checkpointed_layers is None and plan.describe().endswith("; checkpointing 4 of 4 layers (as set)")


# --- the registry -----------------------------------------------------------------------------------------------
class FakeLever:
    """A lever whose levels contain checkpointing's (as selective checkpointing's do)."""

    name = "fake"
    replaces = ("checkpointing",)

    def __init__(self, want="auto"):
        self.want = want

    def requested(self, args):
        return self.want

    def levels(self, trainer):
        return "fake levels"


def test_register_refuses_a_second_lever_of_the_same_name():
    with pytest.raises(ValueError, match="already registered"):
        base.register_lever(checkpointing.CheckpointingLever())
    assert [lv.name for lv in registered()][0] == "checkpointing"
    with pytest.raises(ValueError, match="no lever named 'nope'"):
        get_lever("nope")


def test_the_searched_levels_skip_a_replaced_lever_and_one_a_pin_holds(tmp_path, tok, monkeypatch):
    trainer = make(tmp_path, tok, levers="selective=off")
    assert searched(trainer).name == "checkpointing"
    monkeypatch.setitem(base._REGISTRY, "fake", FakeLever())
    assert searched(trainer) == "fake levels"  # contains checkpointing's levels: searched instead
    monkeypatch.setitem(base._REGISTRY, "fake", FakeLever(want=3))
    assert searched(trainer) is None  # pinned: the lever it replaces would rewrite its layers


# --- levels the user set ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("given,layers", [({"gradient_checkpointing": True}, LAYERS), ({"checkpoint_layers": 2}, 2),
                                          ({"levers": "checkpointing=3"}, 3)])
def test_a_level_the_user_set_is_recorded_in_the_plan_and_its_line(tmp_path, tok, caplog, given, layers):
    trainer = make(tmp_path, tok, **given)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        plan = trainer.tune()
    assert layer_levers(plan) == {"checkpointing": {"layers": layers, "of": LAYERS, "pinned": True}}
    assert f"checkpointing {layers} of {LAYERS} layers (as set)" in caplog.text
    assert gradient_checkpointing.checkpointed_count(trainer.model) == layers
    assert {t.checkpointed_layers for t in trainer.probe_result.trials} == {None}  # probed at it, not searched
    stored = json.loads((tmp_path / PLAN_FILE).read_text())
    assert stored["plan"]["levers"]["checkpointing"] == {"layers": layers, "of": LAYERS, "pinned": True}


def test_an_unset_flag_records_nothing_pinned(tmp_path, tok):
    plan = make(tmp_path, tok, gradient_checkpointing=False).tune()
    assert not layer_levers(plan)


@pytest.mark.parametrize("levers,message", [
    ("nope=2", "levers: no lever named 'nope'"),
    ("checkpointing", "give comma-separated name=value pairs"),
    ("checkpointing=x", "levers: checkpointing='x' must be 'auto' or an integer >= 0"),
    ("checkpointing=1,checkpointing=2", "pins checkpointing twice"),
])
def test_a_bad_pin_is_refused_naming_the_field(levers, message):
    with pytest.raises(ValueError, match=message):
        AccumTrainingArguments(output_dir="unused", use_cpu=True, report_to=[], levers=levers)


def test_checkpointing_pinned_twice_is_refused():
    with pytest.raises(ValueError, match="pins checkpointing, and checkpoint_layers"):
        AccumTrainingArguments(output_dir="unused", use_cpu=True, report_to=[], levers="checkpointing=2",
                               checkpoint_layers=1)


def test_off_and_auto_pins():
    args = AccumTrainingArguments(output_dir="unused", use_cpu=True, report_to=[], levers="checkpointing=off")
    assert checkpointing.requested(args) == 0
    args = AccumTrainingArguments(output_dir="unused", use_cpu=True, report_to=[], levers=" checkpointing = auto ")
    assert checkpointing.requested(args) == "auto"


# --- the one check of checkpoint_layers -------------------------------------------------------------------------
@pytest.mark.parametrize("value,parsed", [("auto", "auto"), (" AUTO ", "auto"), ("3", 3), (0, 0), (None, None),
                                          ("", None), ("null", None), ("off", 0)])
def test_parse_layers(value, parsed):
    assert checkpointing.parse_layers(value) == parsed


@pytest.mark.parametrize("value", ["-1", "x", -2, True, 1.5])
def test_parse_layers_refuses(value):
    with pytest.raises(ValueError, match=r"checkpoint_layers=.* must be 'auto' or an integer >= 0"):
        checkpointing.parse_layers(value)


def test_check_layers_names_the_request_and_the_most_allowed():
    checkpointing.check_layers(4, 4, "M", True, "checkpoint_layers=4")
    with pytest.raises(ValueError, match=r"checkpoint_layers=5, but M has 4 checkpointable decoder layers. Set "
                                         r"checkpoint_layers to at most 4"):
        checkpointing.check_layers(5, 4, "M", True, "checkpoint_layers=5")
    with pytest.raises(ValueError, match="on \\(1\\) or off \\(0\\) only"):
        checkpointing.check_layers(2, 1, "M", False, "checkpoint_layers=2")


def test_the_levels_context_restores_the_model():
    model = build_model(num_layers=3)
    levels = checkpointing.Levels(model, 3, {})
    assert (levels.count, levels.anchors, levels.record(2)) == (3, (0, 3), {"layers": 2, "of": 3})
    with levels.at(2):
        assert gradient_checkpointing.checkpointed_count(model) == 2
    assert gradient_checkpointing.checkpointed_count(model) == 0
    with contextlib.suppress(RuntimeError), levels.at(3):
        raise RuntimeError
    assert gradient_checkpointing.checkpointed_count(model) == 0
