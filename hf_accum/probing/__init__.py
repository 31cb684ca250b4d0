"""One search over a meter. The probe and the estimate are the same search (`loop.probe_micro_batches`, and
`levels.probe_levels` across a lever's levels) over the same step (`probe.make_step_fn`); only the meter differs:
a real step read by `meters.CpuMeter` / `meters.CudaMeter`, or a step on fake tensors read by
`paper_meter.PaperMeter` (`estimate.estimate_model`; `paper.estimate` and `hf-accum probe --estimate` build the
model from its config). `seed.py` starts the real search from the estimate, `engine.py` runs it through a live
DeepSpeed engine, `report.py` shows what was measured (table, plot, plan line, figures).

Reading order for one probe: `probe.probe_model` → `loop.py` (or `levels.py`) → `meters.py` → `report.py`.

What the search yields is a plan (`plan.py`, pure arithmetic: numbers in, numbers out), found by `search.py`'s
`MicroBatchSearch` and, across a lever's levels, `level_choice.py`. Also here: `preserve.py` (the probe leaves no
trace), `loading.py` (the one model and LoRA builder of the probe and the recipes), `flops.py` (MFU),
`kernel_timing.py` (the loss kernels timed on the real step). Imports the levers, `tiny.py`, the window engine,
config and compat; the planning wing, the recipes and the CLI import it.
"""
