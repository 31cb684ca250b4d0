import subprocess
import sys

from hf_accum import __version__
from hf_accum.cli import main


def test_version_from_console_script():
    out = subprocess.run([sys.executable, "-m", "hf_accum.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"hf-accum {__version__}"


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "probe" in capsys.readouterr().out


def test_probe_default_run_plans_accumulation(tmp_path, capsys):
    import json

    out_json, out_png = tmp_path / "plan.json", tmp_path / "curve.png"
    assert main(["probe", "--seq-len", "64", "--json", str(out_json), "--plot", str(out_png)]) == 0
    printed = capsys.readouterr().out
    assert "| micro | peak alloc MiB" in printed and "plan: micro" in printed and "memory model" in printed
    data = json.loads(out_json.read_text())
    for key in ("micro_batch_size", "gradient_accumulation_steps", "world_size", "target_batch_size",
                "max_micro_batch_size", "budget_bytes", "capacity_bytes", "device", "trials"):
        assert key in data
    assert data["micro_batch_size"] * data["gradient_accumulation_steps"] * data["world_size"] == 32
    assert data["gradient_accumulation_steps"] > 1
    assert {"micro_batch_size", "peak_bytes", "fits", "seconds"} <= set(data["trials"][0])
    fitting = [t["peak_bytes"] for t in data["trials"] if t["fits"]]
    assert fitting and max(fitting) <= data["budget_bytes"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


import pytest  # noqa: E402


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--budget", "1.5"], "--budget=1.5 must be a fraction in (0, 1]"),
        (["--budget-bytes", "0"], "--budget-bytes=0 must be a positive integer"),
        (["--target-batch", "9", "--world-size", "2"], "use --target-batch 8 or 10"),
        (["--seq-len", "0"], "--seq-len=0 must be a positive integer"),
        (["--model", "/nonexistent/model-dir"], "model='/nonexistent/model-dir' could not be loaded as a hub id"),
        (["--seq-len", "5000"], "exceeds the model's max_position_embeddings=4096"),
        (["--budget-bytes", "100000"], "even micro-batch 1 does not fit"),
    ],
)
def test_probe_bad_input_says_the_fix(argv, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as info:
        main(["probe", *argv])
    assert message in str(info.value)


def test_quantization_without_bitsandbytes_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if not installed
    with pytest.raises(SystemExit, match=r"needs bitsandbytes, which is not installed.*pip install 'hf-accum\[qlora\]'"):
        main(["probe", "--load-in-4bit"])


def test_8bit_on_a_machine_without_cuda_is_refused_before_loading():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: 8-bit is allowed")
    with pytest.raises(SystemExit, match="8-bit .* needs a CUDA GPU; on CPU use --load-in-4bit"):
        main(["probe", "--load-in-8bit"])


def test_probe_budget_errors_name_the_flags():
    with pytest.raises(SystemExit) as info:
        main(["probe", "--seq-len", "16", "--budget-bytes", str(2**60)])
    message = str(info.value)
    assert message.startswith(f"hf-accum probe: --budget-bytes={2**60} ") and "Set --budget instead" in message
