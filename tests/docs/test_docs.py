"""The manual's code runs as written: every Python and shell block of docs/*.md is executed here (how:
tests/doc_blocks.py), or is marked `<!-- skip (KIND): REASON -->` (a GPU, the Hub, several processes, an install,
or minutes of runtime) and skipped with that reason. Some blocks' results are checked beyond running (CHECKS); the
pictures and the nav are checked too."""

from __future__ import annotations

import json
import math
import os
import re

import pytest

from tests.doc_blocks import (
    ROOT,
    SKIP_KINDS,
    blocks,
    in_process_lines,
    pages,
    read,
    run_in_process,
    run_python,
    run_shell,
)

ALL = [b for page in pages() for b in blocks(page)]
_RAN: dict[str, tuple] = {}  # code -> (what it printed, where): a command shown on two pages runs once


def _loop_losses(ran, cwd):
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", ran.output)]
    assert len(losses) == 2, ran.output  # 32 samples, 16 per optimizer step
    assert all(math.isfinite(x) and x > 0 for x in losses)


def _trained(steps):
    def check(ran, cwd):
        trainer = ran.namespace["trainer"]
        assert trainer.state.global_step == steps
        assert trainer.plan.target_batch_size == 16
        assert trainer.plan.describe() in ran.output

    return check


def _probe_plot(ran, cwd):
    with open(os.path.join(cwd, "probe.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(cwd, "probe.json")) as f:
        assert json.load(f)  # the measurements
    assert "wrote probe.png" in ran.output


def _reused(ran, cwd):
    with open(os.path.join(cwd, "runs", "p", "run_summary.json")) as f:
        assert json.load(f)["reused_stored_plan"] is True


def _resumed(ran, cwd):
    with open(os.path.join(cwd, "runs", "sft", "checkpoint-6", "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 6
    assert "checkpoint-4" in ran.output  # the second run names the checkpoint it resumes


def _fits_table(ran, cwd):
    with open(os.path.join(cwd, "fits.json")) as f:
        cells = json.load(f)["cells"]
    assert len(cells) == 9 and sum(c["fits"] for c in cells) >= 6  # 40 MiB at seq 2048 fits not even 1 row
    assert "| seq len | 40 MiB | 80 MiB | 200 MiB |" in ran.output


def _accelerate_figures(ran, cwd):  # the figures the page quotes are the ones the block prints
    assert "float32 total 29.92 GB training using Adam 119.66 GB" in ran.output
    assert "float16 total 14.96 GB training using Adam 59.83 GB" in ran.output


def _recipe_on_paper(ran, cwd):
    assert "seq 16 (the longest of 2000 training examples)" in ran.output, ran.output
    last = ran.output.strip().splitlines()[-1]
    assert last.startswith("hf_accum plan: micro 2 × accumulation 8 × world 1 = 16; peak ") and "(estimated)" in last


CHECKS = {  # a line of the block -> what its result must show
    "for window in windows(loader, 4):": _loop_losses,
    "trainer = AccumTrainer(model=model, args=args, train_dataset=ds, data_collator=collator)": _trained(3),
    "trainer = AccumSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)": _trained(2),
    "hf-accum probe --model tiny --seq-len 256 --target-batch 32 --json probe.json --plot probe.png": _probe_plot,
    "hf-accum probe lora_sft output_dir=runs/p": _reused,
    "resume_from_checkpoint=true": _resumed,
    "hf-accum probe --estimate --model small --device-memory 40MiB,80MiB,200MiB --seq-len 64,512,2048 --json fits.json":
        _fits_table,
    "total, _ = calculate_maximum_sizes(model)": _accelerate_figures,
    "hf-accum probe --estimate lora_classification gradient_checkpointing=false": _recipe_on_paper,
}


@pytest.mark.parametrize("block", ALL, ids=[b.id for b in ALL])
def test_the_block_runs_as_written(block, tmp_path, monkeypatch, capsys):
    if block.skip:
        kind, reason = block.skip
        assert kind in SKIP_KINDS and len(reason) > 10, block.skip
        pytest.skip(f"{kind}: {reason}")
    if block.kind == "shell" and block.code in _RAN:
        ran, cwd = _RAN[block.code]
    else:
        monkeypatch.chdir(tmp_path)
        cwd = str(tmp_path)
        if block.kind == "python":
            ran = run_python(block.code, capsys)
        elif (lines := in_process_lines(block.code)) is not None:  # hf-accum and python -c lines (doc_blocks)
            ran = run_in_process(lines, capsys, monkeypatch)
        else:
            ran = run_shell(block.code, cwd)
        if block.kind == "shell":
            _RAN[block.code] = ran, cwd
    for line, check in CHECKS.items():
        if line in block.code and not (line == "resume_from_checkpoint=true" and block.kind == "python"):
            check(ran, cwd)


def test_every_check_finds_its_block_and_every_skip_mark_a_block():
    runnable = [b for b in ALL if not b.skip]
    for line in CHECKS:
        assert any(line in b.code for b in runnable), f"no runnable block holds {line!r}"
    for page in pages():
        marks = len(re.findall(r"^<!-- skip \(", read(page), re.M))
        assert marks == sum(1 for b in blocks(page) if b.skip), f"{page}: a skip mark that precedes no block"


def test_the_plain_loop_example_runs(capsys, tmp_path, monkeypatch):
    (block,) = [b for b in blocks("docs/usage.md") if b.section == "Your own training loop"]
    monkeypatch.chdir(tmp_path)
    _loop_losses(run_python(block.code, capsys), str(tmp_path))


def test_the_nav_names_every_page_and_the_pictures_exist():
    config = read("mkdocs.yml")
    nav = set(re.findall(r"^\s+- [^:]+: (\S+\.md)\s*$", config, re.M))
    assert nav == {os.path.relpath(p, "docs") for p in pages()}, nav
    for page in pages():
        for image in re.findall(r"!\[[^\]]*\]\((img/[^)]+)\)", read(page)):
            assert os.path.exists(os.path.join(ROOT, "docs", image)), (page, image)
    assert '--8<-- "CHANGELOG.md"' in read("docs/changelog.md")


def test_the_levers_picture_shows_the_levers_table():
    import importlib.util

    spec = importlib.util.spec_from_file_location("figure", os.path.join(ROOT, "scripts", "docs", "docs_levers_figure.py"))
    figure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figure)
    rows = {row.split("|")[1].strip(): row for row in read("docs/plan.md").splitlines()
            if row.startswith("| ") and "checkpointing per layer" in row or "offload per layer" in row}
    names = {"full checkpointing": "full checkpointing per layer",
             "selective checkpointing": "selective checkpointing per layer",
             "activation offload (CUDA)": "activation offload per layer (CUDA)"}
    assert set(figure.LEVERS) == set(names)
    for lever, figures in figure.LEVERS.items():
        cells = [c.strip() for c in rows[names[lever]].split("|")[4:8]]
        shown = ["—" if v is None else f"{v:+d}%".replace("-", "−") for v in figures]
        assert cells == shown, (lever, cells, shown)
