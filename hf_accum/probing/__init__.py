"""One search over a meter. The probe and the estimate are the same search (`loop.probe_micro_batches`, and
`levels.probe_levels` across a lever's levels) over the same step (`probe.make_step_fn`); only the meter differs:
a real step read by `meters.CpuMeter` / `meters.CudaMeter`, or a step on fake tensors read by
`paper_meter.PaperMeter` (`estimate.estimate_model`; `paper.estimate` and `hf-accum probe --estimate` build the
model from its config). `seed.py` starts the real search from the estimate, `engine.py` runs it through a live
DeepSpeed engine, `report.py` shows what was measured (table, plot, plan line, figures).

Reading order for one probe: `probe.probe_model` → `loop.py` (or `levels.py`) → `meters.py` → `report.py`.
"""
