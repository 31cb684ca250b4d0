"""Past one machine, as users launch it (issue 55 item 6): two torchrun launches on this machine joined by c10d
rendezvous, 2 nodes x 2 ranks (gloo), each node with its own output folder (no shared filesystem,
`save_on_each_node=True`), DDP with a target (`tests/workers/two_node_worker.py`). One plan agreed by all four
ranks; a SIGTERM on one rank of the second node stops every rank after the same step, and each node's checkpoint
holds the plan; the resumed run reads it on every rank, probes nothing, and every step of both runs is the
one-process reference's gradient over all four ranks' micro-batches."""

import os
import subprocess
import sys

import pytest
import torch
import transformers
from packaging import version
from safetensors.torch import load_file

from hf_accum.config.paths import PLAN_FILE
from tests.exactness import StepRecorder, max_step_error, reference_run, tiny_gpt2
from tests.integrations.test_ddp import _free_port
from tests.launch import FORKED, ROOT, child_env, fork_service
from tests.workers.two_node_worker import STEPS, TARGET

pytestmark = pytest.mark.xdist_group("torchrun")

WORKER = os.path.join(ROOT, "tests", "workers", "two_node_worker.py")
STOP_AT = 2


def two_nodes(outs, *argv, timeout=400):
    """Two torchrun launches, one per node folder, joined by c10d rendezvous on a free port: their exit codes and
    outputs. Each rank torchrun starts is forked from the tests' preloaded server (`tests/workers/forked.py`): the
    agents, their rendezvous and signals are torchrun's own; 8 fresh rank interpreters cost 160 CPU-s of imports."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
                               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two_nodes",
                               FORKED, WORKER, str(out), *map(str, argv)],
                              env=child_env(KINETO_LOG_LEVEL="3", **fork_service()), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for out in outs]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
    return [p.returncode for p in procs], outputs


def records(outs, mode):
    """{global rank: record} from both node folders, and {global rank: the folder it wrote to}."""
    found, where = {}, {}
    for out in outs:
        for name in os.listdir(out):
            if name.startswith(f"{mode}.rank"):
                rank = int(name.removeprefix(f"{mode}.rank").removesuffix(".pt"))
                found[rank], where[rank] = torch.load(out / name, weights_only=False), out
    return found, where


@pytest.mark.slow
def test_two_nodes_agree_on_one_plan_stop_together_resume_from_their_own_folders_and_stay_exact(tmp_path):
    outs = [tmp_path / "node_a", tmp_path / "node_b"]
    for out in outs:
        out.mkdir()
    codes, outputs = two_nodes(outs, "stop", STOP_AT)
    said = "\n".join(outputs)
    stopped, where = records(outs, "stop")
    assert sorted(stopped) == [0, 1, 2, 3], said[-4000:]
    assert {where[0], where[1]} != {where[2], where[3]} and where[0] == where[1] and where[2] == where[3]
    plans = [stopped[r]["plan"] for r in range(4)]
    assert all(p == plans[0] for p in plans) and all(stopped[r]["probed"] for r in range(4))
    plan = plans[0]
    assert plan["world_size"] == 4 and plan["target_batch_size"] == TARGET
    assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] * 4 == TARGET
    assert plan["gradient_accumulation_steps"] > 1, plan  # the budget makes the window more than one forward
    assert [stopped[r]["stopped_at"] for r in range(4)] == [STOP_AT] * 4  # every rank after the same step
    # the signalled rank says so, the three others that another rank stopped them, each naming its node's checkpoint
    assert said.count(f"stopped by SIGTERM after optimizer step {STOP_AT}; checkpoint saved to") == 1, said[-4000:]
    assert said.count(f"stopped by another rank after optimizer step {STOP_AT}; checkpoint saved to") == 3
    for out in outs:
        assert said.count(f"checkpoint saved to {out / f'checkpoint-{STOP_AT}'}.") == 2
    assert all(code != 0 for code in codes)  # the run stopped; a scheduler requeues it
    for out in outs:  # each node's own checkpoint, weights and plan: nothing is read from the other node's folder
        # (transformers 5 alone writes the weights on global rank 0 only: hf_accum.compat.node_saving)
        files = set(os.listdir(out / f"checkpoint-{STOP_AT}"))
        assert {PLAN_FILE, "model.safetensors", "config.json", "optimizer.pt"} <= files, sorted(files)

    if version.parse(transformers.__version__) < version.parse("5.18"):
        # transformers 5.17 loads a multi-rank CPU checkpoint with map_location "cpu:0", which torch 2.13 rejects
        # ("don't know how to restore data location ... cpu:0"): its own resume fails, whatever the trainer
        # (tests/trainer/test_preemption.py skips its resume alike). The plan and the stop were checked above.
        pytest.skip("transformers 5.17 cannot resume a multi-rank CPU checkpoint (the plan and the stop were checked)")
    codes, outputs = two_nodes(outs, "resume")
    assert codes == [0, 0], "\n".join(outputs)[-4000:]
    resumed, where = records(outs, "resume")
    assert sorted(resumed) == [0, 1, 2, 3]
    for r in range(4):  # every rank resumed from its own node's checkpoint
        saved = load_file(where[r] / f"checkpoint-{STOP_AT}" / "model.safetensors")
        first = resumed[r]["weights"][0]
        assert saved.keys() <= first.keys() and all(torch.equal(first[k], v) for k, v in saved.items())
    assert all(resumed[r]["plan"] == plan and not resumed[r]["probed"] for r in range(4))  # the stored plan
    for r in (1, 2, 3):  # DDP kept the four ranks' weights equal
        for k, v in resumed[0]["final"].items():
            torch.testing.assert_close(resumed[r]["final"][k], v, rtol=0, atol=0)

    # every optimizer step of both runs against one pass over all four ranks' micro-batches, float64
    recorder = StepRecorder()
    recorder.grads = stopped[0]["grads"] + resumed[0]["grads"]
    recorder.weights = stopped[0]["weights"] + resumed[0]["weights"]
    windows = [sum((record["windows"][s] for record in (run[r] for r in range(4))), [])
               for run in (stopped, resumed) for s in range(len(run[0]["windows"]))]
    assert len(recorder.grads) == len(windows) == STEPS
    assert max_step_error(recorder, reference_run(tiny_gpt2(), recorder, windows, "causal")) <= 1e-10
