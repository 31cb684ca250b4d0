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
