"""Run under `torchrun --nproc_per_node 2` (gloo, CPU): the plain-loop API under DDP, then under FSDP2
(`fully_shard`), saving per rank each step's full gradients and the micro-batches it trained on; then an FSDP2
run where rank 1 runs out of memory mid-window, which must stop every rank with a clear error."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.exactness import lm_examples, pad_collate, tiny_gpt2  # noqa: E402
from tests.test_oom_recovery import OOMAt  # noqa: E402


def full(t):
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


def train(kind, out, rank, oom_calls=()):
    from hf_accum.loop import Accumulator, windows

    model = tiny_gpt2()
    if kind == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        wrapped = fully_shard(model)
    if oom_calls:
        OOMAt(model.transformer.h[1], oom_calls)
    data = lm_examples(24, seed=4)[rank::2]  # each rank its own 12 examples
    loader = [pad_collate(data[i:i + 3]) for i in range(0, 12, 3)]  # micro 3, 4 micro-batches
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    acc = Accumulator(wrapped)
    record = {"grads": [], "weights": [], "windows": [], "losses": []}
    for window in windows(loader, 2):  # accumulation 2: 2 optimizer steps
        record["weights"].append({n: full(p).detach().clone() for n, p in model.named_parameters()})
        loss = acc.backward(window, lambda m, b: m(**b).loss)
        record["grads"].append({n: full(p.grad).detach().clone() for n, p in model.named_parameters()})
        record["windows"].append(window)
        record["losses"].append(float(loss))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.save(record, os.path.join(out, f"{kind}.rank{rank}.pt"))


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    train("ddp", out, rank)
    train("fsdp2", out, rank)
    dist.barrier()
    train("fsdp2-oom", out, rank, oom_calls=(2,) if rank == 1 else ())


if __name__ == "__main__":
    main()
