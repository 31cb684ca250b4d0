"""Everything the arguments, the data and the model's config can tell is checked before the probe, and a refused run
leaves output_dir byte for byte as it found it: absent stays absent, an existing folder keeps its listing and its
files' contents (issue 27, points 3 and 4)."""

import os

import pytest
import torch
import transformers

from hf_accum import AccumTrainer, AccumTrainingArguments
from tests.exactness import lm_examples, pad_collate, tiny_llama

MiB = 2**20


def snapshot(folder):
    """Every path under ``folder`` with its bytes (None for a folder); None when ``folder`` does not exist."""
    if not os.path.exists(folder):
        return None
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            found[os.path.relpath(os.path.join(root, name), folder)] = None
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.relpath(os.path.join(root, name), folder)] = f.read()
    return found


def trainer_for(output_dir, rows, model=None, collate=pad_collate, **kw):
    args = AccumTrainingArguments(output_dir=str(output_dir), target_batch_size=8, memory_budget_bytes=64 * MiB,
                                  use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                                  remove_unused_columns=False, max_steps=2, **kw)
    return AccumTrainer(model=model or tiny_llama(torch.float32), args=args, train_dataset=rows,
                        data_collator=collate)


def all_masked(n=16):
    return [{"input_ids": r["input_ids"], "labels": [-100] * len(r["labels"])} for r in lm_examples(n, seed=1)]


def refused_untouched(trainer, output_dir, message, **train_kw):
    before = snapshot(output_dir)
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ValueError, match=message):
        trainer.train(**train_kw)
    assert trainer.probe_result is None and trainer.plan is None and trainer.state.global_step == 0
    assert all(torch.equal(p, w) for p, w in zip(trainer.model.parameters(), weights))
    return before


CASES = {
    "every label -100": (all_masked, {}, r"Every label of the training set is ignored \('labels' is -100 everywhere"),
    "resume path missing": (lambda: lm_examples(16), {"resume_from_checkpoint": "/nonexistent/checkpoint-4"},
                            r"Can't find a valid checkpoint at /nonexistent/checkpoint-4: no such directory\. Pass "
                            r"resume_from_checkpoint=PATH"),
    "resume True, no checkpoint": (lambda: lm_examples(16), {"resume_from_checkpoint": True},
                                   r"No valid checkpoint found in output directory .*: resume_from_checkpoint=True has "
                                   r"no checkpoint-N folder to resume"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_run_leaves_an_absent_output_dir_absent(tmp_path, case):
    rows, train_kw, message = CASES[case]
    out = tmp_path / "out"
    trainer = trainer_for(out, rows())  # transformers' __init__ makes the folder; the refusal removes it again
    refused_untouched(trainer, out, message, **train_kw)
    assert not out.exists()


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_run_leaves_an_existing_output_dir_as_it_was(tmp_path, case):
    rows, train_kw, message = CASES[case]
    out = tmp_path / "out"
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "readme.txt").write_text("mine")
    (out / "hf_accum_plan.json.bak").write_bytes(b"\x00\x01old")
    before = snapshot(out)
    trainer = trainer_for(out, rows())
    refused_untouched(trainer, out, message, **train_kw)
    assert snapshot(out) == before


def test_tune_checks_the_data_before_probing_too(tmp_path):
    out = tmp_path / "out"
    trainer = trainer_for(out, all_masked())
    with pytest.raises(ValueError, match="Every label of the training set is ignored"):
        trainer.tune()
    assert trainer.probe_result is None and not out.exists()


def test_one_counted_label_anywhere_is_enough(tmp_path):
    rows = all_masked()
    rows[13] = lm_examples(16, seed=1)[13]  # one row with targets
    trainer = trainer_for(tmp_path / "out", rows, auto_tune=False, per_device_train_batch_size=8)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    from hf_accum.trainer.checks.preflight import check_training_data

    check_training_data(trainer)
    assert torch.equal(torch.get_rng_state(), state)  # the check's collation consumed no random numbers


def test_a_run_that_started_owns_its_folder_a_later_refusal_keeps_it(tmp_path):
    out = tmp_path / "out"
    trainer = trainer_for(out, lm_examples(16), auto_tune=False, per_device_train_batch_size=8)
    trainer.train()  # save_strategy="no": the folder transformers made is still empty afterwards
    assert out.is_dir() and not os.listdir(out)
    with pytest.raises(ValueError, match="resume_from_checkpoint=True has no checkpoint-N folder"):
        trainer.train(resume_from_checkpoint=True)
    assert out.is_dir(), "the folder of a run that trained is the run's: a later refused call leaves it"


def list_collate(rows):
    """A collator that returns Python lists where a model takes tensors."""
    return {key: value.tolist() for key, value in pad_collate(rows).items()}


@pytest.mark.parametrize("build, collate, message", [
    (lambda: None, list_collate,
     r"^data_collator returned 'input_ids' as a Python list, not a tensor: return torch tensors from the collator"),
    (lambda: transformers.LlamaModel(tiny_llama(torch.float32).config), pad_collate,
     r"^LlamaModel has no head and returns no loss: load it with its task's head \(AutoModelForCausalLM, or "
     r"LlamaForCausalLM\), or pass compute_loss_func\.$"),
])
def test_a_batch_of_lists_and_a_model_with_no_head_are_refused_in_one_line(tmp_path, build, collate, message):
    """Issue 59, items 2 and 3: a 23-line TypeError from our own checks and a KeyError from the collator before."""
    out = tmp_path / "out"
    trainer = trainer_for(out, lm_examples(16), model=build(), collate=collate)
    refused_untouched(trainer, out, message)
    assert not out.exists()


def test_a_model_with_no_head_and_a_loss_of_its_own_is_trained(tmp_path):
    """A base model whose loss the caller computes (compute_loss_func) is not refused."""
    from hf_accum.trainer.checks.preflight import check_model_computes_a_loss

    trainer = trainer_for(tmp_path / "out", lm_examples(16), model=transformers.LlamaModel(tiny_llama().config))
    trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.last_hidden_state.sum()
    check_model_computes_a_loss(trainer)
