"""benchmarks/bench_gpu.py as a package of sections, one file each (`s1_model.py` ... `s9_loss_kernels.py`),
over `context.py` (settings, clock, context) and `data.py` (data, trainers, goals); `report.py` prints and draws,
`run.py` runs the sections under one clock. The entry point is `python benchmarks/bench_gpu.py` (or
`python -m gpu_bench` from benchmarks/).

One command that checks hf_accum's plan on a GPU; writes one JSON (every figure) and one PNG, prints a table.

    python benchmarks/bench_gpu.py --out DIR            # CUDA: a ~1B Llama from config in bf16 (built for < 9 min)
    python benchmarks/bench_gpu.py --quick --out DIR    # CPU, a tiny Llama: every section, well under a minute
    python benchmarks/bench_gpu.py --sections 2,5 --minutes 4 --out DIR

Sections (each writes its figures and its goals with pass/fail flags into DIR/bench_gpu.json as soon as it ends):
  1 model       a Llama from config (hidden 2048, 16 layers, vocab 128256; no hub) in bf16: parameters, build time,
                weights' memory, one training step's loss (finite);
  2 probe       for full fine-tuning (AdamW), LoRA and QLoRA (where bitsandbytes imports), checkpointing off/on,
                two sequence lengths, two budgets: hf_accum.probing.probe.probe_model's chosen micro-batch, reported maximum,
                seconds and trials, then an exhaustive sweep of real steps around the choice (the largest size that
                really fits, peak allocated, torch.cuda.max_memory_reserved, NVML's used memory per size);
  3 train       AccumTrainer (auto_tune) trains each plan (tight budget and long sequences first, as many as the time
                allows) for 50 steps on long-tailed data whose longest example is the probe's worst case: OOMs seen
                (goal 0), peak reserved vs the budget;
  4 oom         a callback grabs device memory before a window (on CPU: an injected torch.OutOfMemoryError, since
                a real one kills the process): the run recovers with the same effective batch, every sample once;
  5 throughput  tokens/s at the plan vs the best divisor vs micro 1 (steady-state AccumTrainer steps), MFU against
                the device's bf16 peak (hf_accum.probing.flops), AccumTrainer / Trainer step time at the same micro x
                accumulation, interleaved rounds (goal <= 1.01);
  6 tokens      micro_batching "tokens" vs "samples" on long-tailed lengths (forwards, padded tokens, s/step, peak),
                and the fused loss on vs off at one micro-batch (peak, s/step);
  7 estimate    the estimate (fake tensors) beside the measured peaks;
  8 levers      micro-batch x per-layer level (none / full or selective checkpointing / activation offload of k in
                {L/2, L} layers, offload CUDA only) at seq 2048: step time (fastest of 3) and peak allocated and
                reserved per point, an OOM recorded as "OOM"; then AccumTrainer's tuner (checkpoint_layers='auto') under
                a budget that only partly checkpointed levels fit, its choice measured the same way. At most cap8
                seconds (180 on the GPU: ~3 min on an H100): python benchmarks/bench_gpu.py --sections 8 --minutes 4
A section that needs a missing package (bitsandbytes, NVML, matplotlib) skips that part with a line saying so.
--minutes N: sections share the time left; one that runs out stops cleanly, keeps what it measured and says so.
--quick: CPU and float32 even where CUDA exists; figures that only CUDA has are null with the reason.
Plan fields are read through Plan.to_dict() (rows_per_forward, checkpointed_layers, ... where the Plan has them).
"""
