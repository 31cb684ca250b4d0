"""Run under `torchrun --nproc_per_node 2` (gloo, CPU). Modes:
- train: AccumTrainer on a model sharded at load time with FSDP2
  (`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))`) and, for comparison, the same model
  under DDP, same data and target; saves per rank the full final weights, the meter's count of live parameter bytes
  against an independent count of the local shards, the probe's figure (what a step starts with: weights, gradients,
  optimizer state) against an independent count after one real step, and what happens when the sharded run is asked
  to resume or writes a checkpoint.
- oom: the load-time FSDP2 run where rank 1 runs out of memory mid-window; each rank writes what it raised.
- fallback: `fallback_worker.py`'s refusals, written to OUT/fallback (run first, before "train", in one launch).
- seed: the probe seeded by the sharded estimate against the probe unseeded, at four budgets (`seed_mode`).
Modes joined by commas run in turn in one launch.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def args_for(out, **kw):
    from hf_accum import AccumTrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, target_batch_size=8,
                auto_tune=False, max_steps=3, learning_rate=1e-2, max_grad_norm=0.0, report_to=[],
                save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, remove_unused_columns=False,
                ddp_backend="gloo", logging_steps=1)
    return AccumTrainingArguments(**{**base, **kw})


def load(src, sharded):
    from transformers import DistributedConfig, LlamaForCausalLM

    extra = {"distributed_config": DistributedConfig(fsdp_size=2)} if sharded else {}
    return LlamaForCausalLM.from_pretrained(src, dtype=torch.float64, **extra)


def trainer_for(model, args):
    from transformers.trainer_callback import PrinterCallback

    from hf_accum import AccumTrainer
    from tests.exactness import lm_examples, pad_collate

    trainer = AccumTrainer(model=model, args=args, train_dataset=lm_examples(24, seed=3), data_collator=pad_collate)
    trainer.remove_callback(PrinterCallback)
    return trainer


def full_weights(model):
    return {n.removeprefix("module."): (p.full_tensor() if type(p).__name__ == "DTensor" else p).detach().clone()
            for n, p in model.named_parameters()}


def local_storage_bytes(tensors):
    """Bytes of the distinct storages behind these tensors' local shards (counted here, not by hf_accum)."""
    storages = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if type(t).__name__ == "DTensor" else t
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def train_mode(src, out, rank):
    from hf_accum.probing.meters import live_tensor_bytes
    from tests.exactness import lm_examples, pad_collate

    result = {}
    for kind in ("ddp", "fsdp2"):
        model = load(src, kind == "fsdp2")
        if kind == "fsdp2":
            shards = [p.to_local() for p in model.parameters()]
            result["meter_bytes"] = live_tensor_bytes(model)
            result["local_storage_bytes"] = local_storage_bytes(shards + list(model.buffers()))
            result["local_shard_bytes"] = sum(s.numel() * s.element_size() for s in shards)
            result["sharded"] = all(type(p).__name__ == "DTensor" for p in model.parameters())
        trainer = trainer_for(model, args_for(os.path.join(out, kind)))
        result[f"{kind}_policy"] = trainer._build_engine(pad_collate(lm_examples(2)), 2).protocol.policy.value
        trainer.train()
        result[kind] = full_weights(trainer.model)
    # the sharded run asked to resume: refused before anything runs; its own checkpoints hold no optimizer file
    before = full_weights(trainer.model)
    try:
        trainer.train(resume_from_checkpoint=True)
        result["resume_refusal"] = None
    except ValueError as exc:
        result["resume_refusal"] = str(exc)
    after = full_weights(trainer.model)
    result["untouched_by_refusal"] = all(torch.equal(before[n], after[n]) for n in before)
    result["stop_advice"] = trainer._resume_advice("CKPT")
    trainer.control.should_save = True
    trainer._save_checkpoint(trainer.model, None)  # what a stop (signal, non-finite losses) writes
    result["checkpoint_files"] = sorted(os.listdir(os.path.join(out, "fsdp2", "checkpoint-3")))

    # the probe's figure: what each measured step starts with (weights, zeroed gradients, optimizer state)
    model = load(src, True)
    trainer = trainer_for(model, args_for(os.path.join(out, "probe"), auto_tune=True, probe_max_micro_batch=2))
    from hf_accum.probing.meters import CpuMeter

    local, measure = [], CpuMeter.measure  # this rank's own figures, before the ranks agree on the largest

    def recorded(self, fn, **kwargs):
        m = measure(self, fn, **kwargs)
        local.append(m.baseline_bytes)
        return m

    CpuMeter.measure = recorded
    try:
        plan = trainer.tune()
    finally:
        CpuMeter.measure = measure
    result["plan"] = plan.to_dict()
    result["probe_baselines"] = [t.baseline_bytes for t in trainer.probe_result.measured_trials]
    result["probe_local_baselines"] = local
    optimizer = trainer.create_optimizer()  # the optimizer class and settings the probe stepped
    batch = pad_collate(lm_examples(2, seed=1))
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    held = list(model.parameters()) + [p.grad for p in model.parameters()] + list(model.buffers())
    held += [v for state in optimizer.state.values() for v in state.values()]
    result["counted_step_bytes"] = local_storage_bytes(held)
    result["unsharded_step_bytes"] = sum(p.numel() * 8 * 4 for p in model.parameters())  # weight, grad, 2 moments
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def oom_mode(src, out, rank):
    from tests.exactness import train_recording_outcome
    from tests.trainer.test_oom_recovery import OOMAt

    model = load(src, True)
    trainer = trainer_for(model, args_for(os.path.join(out, "oom")))
    if rank == 1:
        OOMAt(model.model.layers[1], [3])  # the second window's first (non-final) forward
    train_recording_outcome(trainer, os.path.join(out, f"oom.rank{rank}.json"), reraise=rank != 1)


def seed_mode(src, out, rank):
    """The probe of the load-time FSDP2 model seeded by the sharded estimate (`probing/seed_sharded.py`): first an
    unseeded probe under the default budget, which every size up to the cap (8) fits, gives the real peaks at the
    smallest and largest sizes it ran; then, at four budgets spread evenly between them (the larger rank's figures,
    so both ranks use the same), the probe seeded and unseeded. Writes OUT/seed.rankR.json: per budget each probe's measured sizes, plan and seed record."""
    import json

    import torch.distributed as dist

    def probe(budget, seeded, cap=8):
        args = args_for(os.path.join(out, "seed", f"{budget}-{seeded}"), auto_tune=True, target_batch_size=2 * cap,
                        per_device_train_batch_size=cap, gradient_accumulation_steps=1, memory_budget_bytes=budget,
                        probe_from_estimate=seeded)
        trainer = trainer_for(model, args)
        plan = trainer.tune()
        result = trainer.probe_result
        return {"sizes": [t.micro_batch_size for t in result.measured_trials], "plan": plan.describe(),
                "peaks": {t.micro_batch_size: t.peak_bytes for t in result.measured_trials},
                "estimate": result.extra.get("estimate")}

    model = load(src, True)
    top = probe(None, False)  # the default budget: every size up to the cap fits, the search climbs to it
    ends = torch.tensor([top["peaks"][min(top["sizes"])], top["peaks"][max(top["sizes"])]], dtype=torch.float64)
    dist.all_reduce(ends, op=dist.ReduceOp.MAX)
    budgets = [int(ends[0] + (ends[1] - ends[0]) * f) for f in (0.2, 0.4, 0.6, 0.8)]
    runs = {b: {"seeded": probe(b, True), "unseeded": probe(b, False)} for b in budgets}
    with open(os.path.join(out, f"seed.rank{rank}.json"), "w") as f:
        json.dump({"top": top, "runs": {str(b): r for b, r in runs.items()}}, f)


def fallback_mode(src, out, rank):
    from tests.workers.fallback_worker import refusals

    refusals(os.path.join(out, "fallback"), rank)


if __name__ == "__main__":
    modes, src, out = sys.argv[1:4]
    for mode in modes.split(","):  # e.g. "fallback,train": one launch, the modes in turn
        {"train": train_mode, "oom": oom_mode, "fallback": fallback_mode, "seed": seed_mode}[mode](src, out, int(os.environ["RANK"]))
