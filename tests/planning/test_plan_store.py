"""The plan file and its key: stable across processes, complete for what changes memory, validated, and every
error naming the file."""

import json
import logging
import os
import subprocess
import sys

import pytest

from hf_accum.planning.store import PLAN_FILE, PlanFileError, canonical, load_stored_plan, plan_from_record
from hf_accum.probing.plan import Plan
from hf_accum.tiny import build_model
from tests.conftest import another_hash_seed, sft_trainer, stored_in

# One xdist worker runs these tests (--dist loadgroup): `stored_sft_plan` is built once, not on each.
pytestmark = pytest.mark.xdist_group("stored_sft_plan")

MiB = 2**20


def make(out, tok, model=None, **kw):
    defaults = dict(output_dir=str(out), target_batch_size=16, memory_budget_bytes=8 * MiB, max_steps=1)
    return sft_trainer(tok, model, **{**defaults, **kw})


@pytest.mark.parametrize(
    "value,expected",
    [
        ({"b": 1, "a": {"z", "y", "x"}}, {"a": ["x", "y", "z"], "b": 1}),
        ((1, (2, 3)), [1, [2, 3]]),
        ({"m": frozenset({3, 1, 2})}, {"m": [1, 2, 3]}),
        ({"d": object}, {"d": "<class 'object'>"}),
    ],
)
def test_canonical_is_plain_sorted_json(value, expected):
    assert canonical(value) == expected
    assert json.dumps(canonical(value)) == json.dumps(expected)


_REUSE_SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)
from peft import LoraConfig, get_peft_model
from hf_accum import AccumTrainer, AccumTrainingArguments
from hf_accum.tiny import SFTCollator, build_model, build_sft_dataset, build_tokenizer
tok = build_tokenizer()
model = get_peft_model(build_model(tokenizer=tok), LoraConfig(r=4, target_modules=MODULES))
args = AccumTrainingArguments(output_dir=sys.argv[1], target_batch_size=16, memory_budget_bytes=8 * 2**20,
                              use_cpu=True, report_to=[], max_steps=1, save_strategy="no")
trainer = AccumTrainer(model=model, args=args, train_dataset=build_sft_dataset(48, tok), data_collator=SFTCollator(tok))
trainer.tune()
print(json.dumps({"probed": trainer.probe_result is not None,
                  "order": list(model.peft_config["default"].target_modules)}))
"""
_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_REUSE_SCRIPT = _REUSE_SCRIPT.replace("MODULES", repr(_MODULES))


@pytest.mark.slow
def test_a_lora_plan_is_reused_by_another_process(tmp_path, monkeypatch, capsys):
    # peft's target_modules is a set: its order follows the hash seed, so an unsorted key differs per process.
    # The script probes and stores here, in this process (its own hash seed), then runs again in a fresh process
    # whose hash seed orders the set otherwise (asserted below): one launch, not two, for the same two orders.
    monkeypatch.setattr(sys, "argv", ["-c", str(tmp_path)])
    exec(compile(_REUSE_SCRIPT, "<reuse script>", "exec"), {"__name__": "__main__"})
    here = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    seed = another_hash_seed(_MODULES, here["order"])
    env = {**os.environ, "PYTHONHASHSEED": seed, "KINETO_LOG_LEVEL": "3"}
    done = subprocess.run([sys.executable, "-c", _REUSE_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    there = json.loads(done.stdout.strip().splitlines()[-1])
    assert there["order"] != here["order"]  # the two processes really ordered the set differently
    assert [here["probed"], there["probed"]] == [True, False]


def test_a_lower_probe_cap_is_not_ignored_when_a_plan_is_stored(tmp_path, tok, stored_sft_plan):
    assert stored_in(tmp_path, stored_sft_plan).micro_batch_size > 1
    capped = make(tmp_path, tok, probe_max_micro_batch=1)
    plan = capped.tune()
    assert capped.probe_result is not None and plan.micro_batch_size == 1


def test_another_attention_implementation_is_probed_again(tmp_path, tok, stored_sft_plan):
    stored_in(tmp_path, stored_sft_plan)
    model = build_model(tokenizer=tok)
    model.set_attn_implementation("eager")
    other = make(tmp_path, tok, model=model)
    other.tune()
    assert other.probe_result is not None
    assert json.loads((tmp_path / PLAN_FILE).read_text())["key"]["attn_implementation"] == "eager"


BAD_PLANS = [
    ({"micro_batch_size": "4", "gradient_accumulation_steps": 4, "world_size": 1, "target_batch_size": 16},
     "micro_batch_size='4' is not a positive integer"),
    ({"micro_batch_size": -4, "gradient_accumulation_steps": -4, "world_size": 1, "target_batch_size": 16},
     "micro_batch_size=-4 is not a positive integer"),
    ({"micro_batch_size": 4, "gradient_accumulation_steps": 2, "world_size": 1, "target_batch_size": 16},
     "micro 4 × accumulation 2 does not cut a window of 16 samples"),
    ({"micro_batch_size": True, "gradient_accumulation_steps": 16, "world_size": 1, "target_batch_size": 16},
     "micro_batch_size=True is not a positive integer"),
    ({"micro_batch_size": 4, "world_size": 1, "target_batch_size": 16}, "lacks gradient_accumulation_steps"),
]


@pytest.mark.parametrize("plan,problem", BAD_PLANS)
def test_invalid_plans_are_refused_naming_the_file(tmp_path, plan, problem):
    (tmp_path / PLAN_FILE).write_text(json.dumps({"plan": plan, "key": {}}))
    with pytest.raises(PlanFileError) as info:
        load_stored_plan(str(tmp_path))
    assert str(info.value).startswith(f"{tmp_path / PLAN_FILE}: ") and problem in str(info.value)


@pytest.mark.parametrize("plan,problem", BAD_PLANS[:2])
def test_a_stored_plan_that_cannot_be_trusted_is_named_and_probed_again(tmp_path, tok, caplog, plan, problem,
                                                                         stored_sft_plan):
    stored_in(tmp_path, stored_sft_plan)
    path = tmp_path / PLAN_FILE
    record = json.loads(path.read_text())
    record["plan"] = plan
    path.write_text(json.dumps(record))
    again = make(tmp_path, tok)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        good = again.tune()
    warning = next(r.getMessage() for r in caplog.records if "ignoring the stored plan" in r.getMessage())
    assert f"{path}: {problem}" in warning and "Probing again" in warning
    assert again.probe_result is not None and good.micro_batch_size > 0
    assert again.args.per_device_train_batch_size == good.window  # loaded whole, cut by the engine
    assert json.loads(path.read_text())["plan"] == good.to_dict()  # rewritten


@pytest.mark.parametrize("text,problem", [("{not json", "cannot be read as JSON"), ("[1, 2]", 'has no "plan" object')])
def test_a_corrupt_plan_file_raises_naming_it(tmp_path, text, problem):
    (tmp_path / PLAN_FILE).write_text(text)
    with pytest.raises(PlanFileError, match=f"{tmp_path / PLAN_FILE}.*{problem}"):
        load_stored_plan(str(tmp_path))
    assert load_stored_plan(str(tmp_path / "absent")) is None


def test_a_plan_with_negative_factors_is_invalid():
    with pytest.raises(ValueError, match="micro_batch_size=-4 is not a positive integer"):
        Plan(-4, -4, 1, 16)


@pytest.mark.parametrize("plan", [
    Plan(2, 2, 2, 8, engine="DeepSpeed ZeRO-3"),
    Plan(4, 1, 2, 8, token_budget=40, token_model={"lengths": [4, 8], "rows_at": {"4": 2, "8": 1}, "usable_bytes": 1.0,
                                                   "per_token_bytes": 1.0, "per_token_sq_bytes": 0.0}),
], ids=["engine", "token budget"])
def test_a_plan_reads_back_whole_with_its_optional_fields(plan):
    # a stored token plan that lost its budget would forward every window uncut
    assert plan_from_record({"plan": plan.to_dict()}, "hf_accum_plan.json") == plan


def test_a_stale_stored_plan_says_which_part_of_its_key_changed(tmp_path, tok, caplog, stored_sft_plan):
    """Issue 42 item 14: the stored plan was re-probed without a word."""
    stored_in(tmp_path, stored_sft_plan)
    record = json.loads((tmp_path / PLAN_FILE).read_text())
    record["key"]["seq_len"] -= 1
    record["key"]["versions"]["transformers"] = "0.0.1"
    (tmp_path / PLAN_FILE).write_text(json.dumps(record))
    again = make(tmp_path, tok)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        again.tune()
    assert again.probe_result is not None  # probed again
    lines = [r.getMessage() for r in caplog.records if "is not reused" in r.getMessage()]
    seq = record["key"]["seq_len"]
    assert lines == [f"hf_accum: the plan stored in {tmp_path / PLAN_FILE} is not reused: seq_len ({seq} -> {seq + 1}), "
                     "versions.transformers ('0.0.1' -> " + repr(json.loads((tmp_path / PLAN_FILE).read_text())[
                         "key"]["versions"]["transformers"]) + ") changed since it was probed; probing again."]


def test_packages_that_cannot_change_the_plan_stay_out_of_its_key(tmp_path, tok, stored_sft_plan):
    """bitsandbytes (and peft) entered the key of a run that uses neither: installing them re-probed it."""
    stored_in(tmp_path, stored_sft_plan)
    versions = json.loads((tmp_path / PLAN_FILE).read_text())["key"]["versions"]
    assert sorted(versions) == ["hf-accum", "torch", "transformers"]
