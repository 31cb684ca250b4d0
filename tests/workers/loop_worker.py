"""Run under `torchrun --nproc_per_node 2` (gloo, CPU). Modes:
- runs: the plain-loop API under DDP, then under FSDP2 (`fully_shard`), saving per rank each step's full gradients,
  the micro-batches it trained on and the final weights; an uninterrupted FSDP2 + AdamW run of 4 optimizer steps,
  and the same run stopped after 2 with a torch.distributed.checkpoint (model, optimizer, Accumulator); then an
  FSDP2 run where rank 1 runs out of memory mid-window, which must stop every rank with a clear error.
- resume: a new process group resumes that checkpoint and trains the last 2 steps.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.exactness import lm_examples, pad_collate, tiny_gpt2  # noqa: E402
from tests.trainer.test_oom_recovery import OOMAt  # noqa: E402


def full(t):
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


def full_weights(model):
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


def wrap(kind):
    model = tiny_gpt2()
    if kind == "ddp":
        return model, torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    return model, fully_shard(model)


def train(kind, out, rank, oom_calls=()):
    from hf_accum.loop import Accumulator, windows

    model, wrapped = wrap(kind)
    if oom_calls:
        OOMAt(model.transformer.h[1], oom_calls)
    data = lm_examples(24, seed=4)[rank::2]  # each rank its own 12 examples
    loader = [pad_collate(data[i:i + 3]) for i in range(0, 12, 3)]  # micro 3, 4 micro-batches
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    acc = Accumulator(wrapped)
    record = {"grads": [], "weights": [], "windows": [], "losses": []}
    for window in windows(loader, 2):  # accumulation 2: 2 optimizer steps
        record["weights"].append(full_weights(model))
        loss = acc.backward(window, lambda m, b: m(**b).loss)
        record["grads"].append({n: full(p.grad).detach().clone() for n, p in model.named_parameters()})
        record["windows"].append(window)
        record["losses"].append(float(loss))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    record["final"] = full_weights(model)
    torch.save(record, os.path.join(out, f"{kind}.rank{rank}.pt"))


STEPS, STOP_AT = 4, 2


def adam_run(out, rank, name, start=0, stop=STEPS, resume=None):
    """FSDP2 + AdamW over this rank's 24 examples (micro 3, accumulation 2): optimizer steps [start, stop)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from hf_accum.loop import Accumulator, windows

    model, wrapped = wrap("fsdp2")
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    acc = Accumulator(wrapped)
    if resume is not None:
        model_sd, optim_sd = get_state_dict(wrapped, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "accumulator": acc.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=resume)
        set_state_dict(wrapped, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        acc.load_state_dict(state["accumulator"])
        assert state["step"] == start, state["step"]
    data = lm_examples(48, seed=5)[rank::2]
    loader = [pad_collate(data[i:i + 3]) for i in range(0, 24, 3)]
    for step, window in enumerate(windows(loader, 2)):
        if step < start:
            continue  # the data a resumed run already trained on
        if step == stop:
            break
        acc.backward(window, lambda m, b: m(**b).loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if stop < STEPS:
        model_sd, optim_sd = get_state_dict(wrapped, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "accumulator": acc.state_dict(), "step": stop}
        dcp.save(state, checkpoint_id=os.path.join(out, "dcp"))
    torch.save(full_weights(model), os.path.join(out, f"{name}.rank{rank}.pt"))


def main():
    mode, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    if mode == "resume":
        adam_run(out, rank, "resumed", start=STOP_AT, resume=os.path.join(out, "dcp"))
        dist.destroy_process_group()
        return
    train("ddp", out, rank)
    train("fsdp2", out, rank)
    adam_run(out, rank, "uninterrupted")
    adam_run(out, rank, "stopped", stop=STOP_AT)
    dist.barrier()
    # torchrun sends SIGTERM to the other ranks as soon as one fails; a loop that handles preemption (as
    # AccumTrainer does) finishes its own error first. Without this the check of rank 0's message would race it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    train("fsdp2-oom", out, rank, oom_calls=(2,) if rank == 1 else ())


if __name__ == "__main__":
    main()
