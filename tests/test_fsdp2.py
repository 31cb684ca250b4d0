"""FSDP2 applied at load time (transformers' DistributedConfig) with two gloo ranks on CPU: AccumTrainer ends with
the weights DDP ends with on the same data and target (accumulation 2), the meter counts each rank's local shards,
and the window protocol treats it as a sharded engine (an OOM stops every rank)."""


import pytest
import torch
import transformers
from packaging import version

from .exactness import tiny_llama
from .test_ddp import _torchrun

needs_load_time_fsdp2 = pytest.mark.skipif(
    version.parse(transformers.__version__) < version.parse("5.18"),
    reason="load-time FSDP2 (DistributedConfig fsdp_size) needs transformers newer than 5.17")


@pytest.mark.slow
@needs_load_time_fsdp2
def test_load_time_fsdp2_matches_ddp_and_the_meter_counts_local_shards(tmp_path):
    src = tmp_path / "model"
    initial = tiny_llama(torch.float64)
    initial.save_pretrained(src)
    proc = _torchrun("fsdp2_worker.py", src, tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    start = {n: p.detach() for n, p in initial.named_parameters()}
    for r in (0, 1):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert res["sharded"] and res["fsdp2_policy"] == "stop" and res["ddp_policy"] == "rerun"
        # the meter reads each rank's local shards (a DTensor's storage pointer is not readable) and counts the
        # memory they keep alive: on CPU, transformers' load-time sharding leaves each shard a view of a storage
        # of the parameter's full size, so that is what the plan must budget for
        assert res["meter_bytes"] == res["local_storage_bytes"] >= res["local_shard_bytes"]
        assert res["local_shard_bytes"] < sum(p.numel() * 8 for p in initial.parameters())
        ddp, fsdp = res["ddp"], res["fsdp2"]
        num = sum(float(((fsdp[n] - start[n]) - (ddp[n] - start[n])).pow(2).sum()) for n in start)
        den = sum(float((ddp[n] - start[n]).pow(2).sum()) for n in start)
        assert den > 0 and (num / den) ** 0.5 <= 1e-5


@pytest.mark.slow
def test_an_fsdp_request_that_would_fall_back_is_refused_on_every_rank(tmp_path):
    import json

    proc = _torchrun("fallback_worker.py", tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for r in (0, 1):
        messages = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "fsdp=" in messages["fsdp_on_cpu"] and "accelerate runs MULTI_CPU" in messages["fsdp_on_cpu"]
        assert "training sees world size 1: every rank would train on the same data" in messages["world_one"]
