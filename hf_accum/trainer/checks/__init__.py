"""What the trainer refuses before work: at construction (`construction.py`), before the probe (`preflight.py`: the
data, the output directory), on the model and data themselves (`accumulation_check.py`) and in a LoRA adapter's
target list (`lora_targets.py`). Each message names the argument and the fix."""
