"""The test launcher (`tests.launch`) against torchrun: the same variables for every rank, torchrun's handling of a
failed rank, and a timeout that leaves no rank behind."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.integrations.test_ddp import _free_port
from tests.launch import TORCHRUN_KEYS, child_env, launch

pytestmark = pytest.mark.xdist_group("torchrun")

DUMP = """import json, os, sys
base = set(json.loads(os.environ["BASE_KEYS"]))
print(json.dumps({k: v for k, v in os.environ.items() if k not in base}))
"""


def _ranks(stdout):
    return sorted((json.loads(line) for line in stdout.splitlines() if line.startswith("{")),
                  key=lambda env: env["RANK"])


def test_every_rank_gets_what_torchrun_gives_it(tmp_path):
    script = tmp_path / "dump.py"
    script.write_text(DUMP)
    base = json.dumps(sorted(child_env()) + ["BASE_KEYS"])
    real = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={_free_port()}", str(script)], env=child_env(BASE_KEYS=base),
                          capture_output=True, text=True, timeout=120)
    assert real.returncode == 0, real.stderr[-3000:]
    ours = launch(str(script), env={"BASE_KEYS": base}, timeout=120)
    assert ours.returncode == 0, ours.stderr[-3000:]
    real_ranks, our_ranks = _ranks(real.stdout), _ranks(ours.stdout)
    assert [r["RANK"] for r in real_ranks] == [r["RANK"] for r in our_ranks] == ["0", "1"]
    for theirs, mine in zip(real_ranks, our_ranks):
        # OMP_NUM_THREADS=1 is in both environments already (child_env), as torchrun would set it
        assert set(theirs) == set(mine) == set(TORCHRUN_KEYS) - {"OMP_NUM_THREADS"}
        differ = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}  # a free port; a file in the launch's own folder
        assert {k: v for k, v in theirs.items() if k not in differ} == {k: v for k, v in mine.items()
                                                                         if k not in differ}
        assert mine["TORCHELASTIC_ERROR_FILE"].endswith(f"/{mine['LOCAL_RANK']}/error.json")


FAIL_ONE = """import os, signal, sys, time
ready = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ready")
if os.environ["RANK"] == "1":
    while not os.path.exists(ready):  # rank 0 is listening for SIGTERM
        time.sleep(0.01)
    raise SystemExit(3)
signal.signal(signal.SIGTERM, lambda *_: (print("rank 0 ended by SIGTERM", flush=True), os._exit(9)))
os.write(1, b"rank 0 waits\\n")  # a file descriptor write: the launch reads what C++ code prints too
open(ready, "w").close()
time.sleep(60)
"""


def test_a_failed_rank_ends_the_others_as_torchrun_does(tmp_path):
    script = tmp_path / "fail_one.py"
    script.write_text(FAIL_ONE)
    start = time.monotonic()
    proc = launch(str(script), timeout=120)
    assert time.monotonic() - start < 30
    assert proc.returncode == 1
    assert "rank 0 waits\nrank 0 ended by SIGTERM" in proc.stdout


def test_a_launch_past_its_timeout_raises_and_leaves_no_rank(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text(f"import os, time\nopen({str(tmp_path)!r} + '/pid' + os.environ['RANK'], 'w').write(str(os.getpid()))"
                      "\ntime.sleep(120)\n")
    with pytest.raises(subprocess.TimeoutExpired) as late:
        launch(str(script), timeout=5)
    for rank in (0, 1):  # each rank said where it was: the script's sleep
        assert f"rank {rank}'s stderr" in str(late.value)
    assert str(late.value).count(f'File "{script}", line 3 in <module>') == 2
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    for pid in pids:  # killed and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
