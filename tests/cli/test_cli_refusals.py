"""`hf-accum train` refusals a new user meets: one line, exit 2, no traceback, nothing left behind, and before the
data is tokenized or the model built."""

import os

import pytest

from hf_accum.cli import main
from hf_accum.config.paths import can_create_in

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_an_output_dir_root_cannot_create_is_one_line_exit_2(capsys):
    if can_create_in("/proc"):  # pragma: no cover - not Linux
        pytest.skip("/proc is writable here")
    assert main(["train", "lora_sft", "output_dir=/proc/nope", "max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "output_dir='/proc/nope' cannot be written" in err and "Traceback" not in err


def test_the_write_check_leaves_the_folder_as_it_was(tmp_path):
    assert can_create_in(str(tmp_path)) and os.listdir(tmp_path) == []
    assert not can_create_in(str(tmp_path / "absent"))


def test_too_many_checkpoint_layers_are_refused_before_the_data_and_leave_no_folder(tmp_path, capsys, monkeypatch):
    from hf_accum.recipes import run

    def no_data(*_a, **_k):
        raise AssertionError("the data was built before the refusal")

    monkeypatch.setattr(run, "build_data", no_data)
    out = tmp_path / "run"
    assert main(["train", "lora_sft", "gradient_checkpointing=null", "checkpoint_layers=5", f"output_dir={out}",
                 "max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert "training.checkpoint_layers=5, but tiny has 2 decoder layers" in err
    assert not out.exists()


def test_a_fitting_checkpoint_layers_passes_the_early_check(tmp_path):
    from hf_accum.recipes import load_recipe
    from hf_accum.recipes.model import check_layers_requested

    recipe = load_recipe("lora_sft", ["checkpoint_layers=2", f"output_dir={tmp_path}"])
    check_layers_requested(recipe, recipe.validate())  # 2 of 2 layers: no error


def test_a_stopped_cli_run_says_the_cli_command_that_resumes_it(tmp_path, monkeypatch, caplog):
    import signal

    from transformers import TrainerCallback

    from hf_accum.recipes import run
    from hf_accum.trainer.resilience.preemption import EXIT_PREEMPTED

    class StopAtStep2(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    plain = run.run_recipe
    monkeypatch.setattr(run, "run_recipe", lambda *a, **k: plain(*a, callbacks=[StopAtStep2()], **k))
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        main(["train", "lora_sft", f"output_dir={out}", "max_steps=4", "data.num_examples=64"])
    assert stopped.value.code == EXIT_PREEMPTED
    message = str(stopped.value)
    assert f"Resume with: hf-accum train lora_sft output_dir={out} max_steps=4 data.num_examples=64 " \
           "resume_from_checkpoint=true" in message
    assert "trainer.train(" not in message


@pytest.mark.parametrize("existed", [False, True])
def test_ctrl_c_during_start_up_is_one_line_and_leaves_output_dir_as_it_was(tmp_path, capsys, monkeypatch, existed):
    """Issue 42 item 4: a Ctrl-C while probing was a 27-frame KeyboardInterrupt traceback."""
    from hf_accum.trainer import AccumulationMixin

    out = tmp_path / "run"
    if existed:
        out.mkdir()
        (out / "notes.txt").write_text("mine")

    def interrupted(self, *args, **kwargs):
        assert out.is_dir()  # the Trainer made the folder: it must go again
        raise KeyboardInterrupt

    monkeypatch.setattr(AccumulationMixin, "tune", interrupted)
    assert main(["train", "lora_sft", "max_steps=2", f"output_dir={out}"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    where = f"{out} is as it was" if existed else f"{out} was not created"
    assert err[-1] == f"hf-accum train: stopped (Ctrl-C) before training began: nothing was trained or written ({where})"
    assert not any("Traceback" in line for line in err)
    assert sorted(os.listdir(out)) == ["notes.txt"] if existed else not out.exists()
