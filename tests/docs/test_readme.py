"""README's runnable examples run as written: its Python example trains, and every shell block it shows is either
run or marked with why not (`tests/doc_blocks.py`). README stays a front page: at most 200 lines, the CI's test
command verbatim, and links into the manual that resolve."""

import os
import re

import pytest

from tests.doc_blocks import ROOT, SKIP_KINDS, blocks, read, run_python


def test_the_code_example_runs(capsys, tmp_path, monkeypatch):
    (example,) = [b for b in blocks("README.md") if b.kind == "python"]
    assert example.section == "Use it in your code" and len(example.code.strip().splitlines()) <= 15
    monkeypatch.chdir(tmp_path)
    ran = run_python(example.code, capsys)
    trainer = ran.namespace["trainer"]
    assert trainer.state.global_step == 3 and trainer.plan.target_batch_size == 16
    assert trainer.plan.describe() in ran.output
    assert os.path.exists(tmp_path / "out" / "hf_accum_plan.json")


def test_every_shell_block_says_why_it_is_not_run_here():
    shell = [b for b in blocks("README.md") if b.kind == "shell"]
    assert shell
    for block in shell:
        assert block.skip and block.skip[0] in SKIP_KINDS, block.id


def test_the_front_page_stays_short_and_its_commands_are_cis():
    text = read("README.md")
    assert len(text.splitlines()) <= 200
    ci = read(".ci/run")
    test_command = '. .venv/bin/activate && pip install -e ".[dev]" && python -m pytest -q -n 2 --dist loadgroup'
    assert test_command in text and test_command in ci
    first = next(b for b in blocks("README.md") if b.kind == "shell").code.strip()
    assert first.endswith("hf-accum train lora_sft") and 'pip install -e ".[recipes]"' in first
    assert re.search(r"takes about \d+ minutes", text)
    for target in re.findall(r"\]\(((?:docs/)?[\w/.-]+\.md)(?:#[\w-]+)?\)", text):
        assert os.path.exists(os.path.join(ROOT, target)), target


if __name__ == "__main__":
    pytest.main([__file__])
