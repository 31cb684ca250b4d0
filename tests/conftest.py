"""Shared pytest hooks, fixtures (`tok`, the config-only Llamas `llama_folder` and `deep_folder`) and the trainer factory the tuning tests share (`sft_trainer`)."""

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (CI must not pass or fail by the draw); a defect one of them
# finds is pinned as its own test (see tests/probing/test_plan.py::test_known_staircase_case_misses_the_goal).
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")

# The tests' models are tiny: on a shared 2-core machine two intra-op threads contend and make them 10-100x
# slower than one. One thread also makes float results independent of the machine's core count.
torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which it completes (below)
def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with the reason, on machines without CUDA. Under ``--dist loadgroup``
    the tests marked ``xdist_group`` get their group's suffix (`_group_by_mark`)."""
    _group_by_mark(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Everything alive once the test modules are imported (torch, transformers, TRL, hf_accum: ~580,000 objects,
    32 tensors of 1.7 KB) lives to the end of the session: ``gc.freeze()`` keeps it out of every later cyclic
    collection. Each full collection walked all of it (~0.35 s), and there are hundreds: Python's own, and the one
    hf_accum runs after every out-of-memory error (`window.oom.free_memory`), which the tests inject by the
    hundred. Measured on tests/window and two OOM files: 40 s of 114 in the collector, 7 s of 82 frozen. Objects
    created later are collected as before; frozen ones still die by reference count. `pytest_runtest_setup` does
    the same again as each test module starts."""
    import gc

    gc.collect()
    gc.freeze()


_FROZEN_AT = {"module": None}


def pytest_runtest_setup(item):
    """What a test module's first test finds alive (what the tests before it imported: TRL, peft, the model
    classes; the session's fixtures) is frozen as well, once the previous module's fixtures are gone (pytest
    tears them down before this setup) and collected. Three heavy files (test_paper_session, test_recipes,
    test_grpo): the full collections took 4.2 CPU-s of 74 with the freeze at collection alone, 1.5 of 71 with this."""
    import gc

    module = item.nodeid.split("::")[0]
    if module != _FROZEN_AT["module"]:
        _FROZEN_AT["module"] = module
        gc.collect()
        gc.freeze()


def _group_by_mark(config, items):
    """``--dist loadgroup`` sends the tests marked ``xdist_group`` to one worker as one unit, by the suffix
    ``@GROUP`` xdist appends to their node ids. pytest-xdist 3.8 writes it to ``item._nodeid``, which pytest 9.2's
    structured node ids no longer read (pytest-dev/pytest-xdist#1386): the groups were silently ignored and two
    multi-rank launches ran at once. Where the suffix did not take, it is set here; a no-op where xdist's did."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid.rpartition("]")[2] and hasattr(item, "_id"):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")


@pytest.fixture(scope="module")
def tok():
    """The tiny model's character-level tokenizer (`hf_accum.tiny`), one per test module."""
    from hf_accum.tiny import build_tokenizer

    return build_tokenizer()


def _llama_config_folder(tmp_path_factory, name, **sizes):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp(name)
    LlamaConfig(vocab_size=512, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                **sizes).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A folder holding only the config.json of a 2-layer Llama (hidden 64, vocab 512, 4096 positions): what
    `--estimate` builds on paper."""
    return _llama_config_folder(tmp_path_factory, "llama", hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2)


@pytest.fixture(scope="module")
def deep_folder(tmp_path_factory):
    """Eight layers: checkpointing them saves more than their recomputation costs at seq 2048."""
    return _llama_config_folder(tmp_path_factory, "deep", hidden_size=128, intermediate_size=512,
                                num_hidden_layers=8)


@pytest.fixture(scope="session")
def ddp_runs(tmp_path_factory):
    """One two-rank launch (`tests/workers/ddp_worker.py`) of every DDP case `tests/integrations/test_ddp.py` and
    `tests/levers/test_fused_loss.py` check: the folder holding each run's per-rank records. Tests that read it are
    in the xdist group "torchrun", so one worker launches it once."""
    from tests.integrations.test_ddp import RUNS, UNEVEN, launch_two_ranks

    out = tmp_path_factory.mktemp("ddp")
    launch_two_ranks(out, [*RUNS, UNEVEN])
    return out


@pytest.fixture(scope="session")
def stored_sft_plan(tmp_path_factory):
    """What a first tuned run of `sft_trainer` (target 16, an 8 MiB budget) probes and stores: its plan and its plan
    file, probed once for the tests that start from a stored plan (`stored_in` copies the file into their own
    output_dir: nothing in the file's key names the folder)."""
    from hf_accum.planning.store import PLAN_FILE
    from hf_accum.tiny import build_tokenizer

    folder = tmp_path_factory.mktemp("stored_sft_plan")
    first = sft_trainer(build_tokenizer(), output_dir=str(folder), target_batch_size=16, memory_budget_bytes=8 * 2**20,
                        max_steps=1)
    plan = first.tune()
    assert first.probe_result is not None and (folder / PLAN_FILE).exists()
    return plan, folder / PLAN_FILE


def stored_in(output_dir, stored):
    """``output_dir`` as the first run (`stored_sft_plan`) left it: a copy of its plan file. Returns the plan."""
    import shutil

    shutil.copy(stored[1], output_dir)
    return stored[0]


def sft_trainer(tok, model=None, **kw):
    """An `AccumTrainer` on 48 generated SFT rows (the tiny model unless ``model``), on CPU, saving and reporting
    nothing; ``kw`` are the arguments (each test module passes its own defaults). The probe is not seeded by the
    estimate unless ``probe_from_estimate=True``: the seed only says where the search starts (the plan is the measured
    one either way), and on this model the estimate's fake steps cost ~80% of a tune (3-4.5 s) where the real steps
    it saves cost milliseconds; tests/probing/test_estimate_seed.py and test_estimate_levels.py test the seed."""
    from hf_accum import AccumTrainer, AccumTrainingArguments
    from hf_accum.tiny import SFTCollator, build_model, build_sft_dataset

    base = dict(use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, probe_from_estimate=False)
    args = AccumTrainingArguments(**{**base, **kw})
    return AccumTrainer(model=model if model is not None else build_model(tokenizer=tok), args=args,
                        train_dataset=build_sft_dataset(48, tok), data_collator=SFTCollator(tok))


def another_hash_seed(names, order):
    """A PYTHONHASHSEED under which a fresh interpreter iterates ``set(names)`` in another order than ``order``: a
    process launched with it orders a set of these strings otherwise than the one that produced ``order``. Each try
    is a bare interpreter (no imports: milliseconds)."""
    import json
    import os
    import subprocess
    import sys

    code = f"import json; print(json.dumps(list(set({list(names)!r}))))"
    for seed in map(str, range(1, 100)):
        done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed})
        if json.loads(done.stdout) != list(order):
            return seed
    raise AssertionError(f"no hash seed in 1..99 orders {names} otherwise than {order}")


@pytest.fixture(scope="session")
def recipe_probe():
    """``recipe_probe(name, *overrides)``: the recipe's real probe (`recipes.run.probe_recipe`), run once per session
    for the tests that compare an estimate with it (tests/recipes/test_estimate_recipes.py,
    tests/probing/test_estimate_pairs.py). Read only: nothing a test does changes it. Those modules are in the xdist
    group "recipe_probe", so one worker probes each recipe once."""
    from hf_accum.recipes.run import probe_recipe

    probes = {}

    def probe(name, *overrides):
        if (name, overrides) not in probes:
            probes[name, overrides] = probe_recipe(name, list(overrides), say=lambda _msg: None)
        return probes[name, overrides]

    return probe
