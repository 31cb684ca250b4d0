"""What keeps a run alive and lets it stop cleanly: which checkpoint may be resumed and with which plan
(`checkpoints.py`), stop requests from signals (`preemption.py`), non-finite gradients (`finite_grads.py`), what a
stopped run says (`stopping.py`) and output that must not kill a stopping run (`output_guard.py`). An OOM's re-cut
is the window engine's (`window/`), growing back the planner's (`planning/growback.py`)."""
