"""The integrations wing: how hf_accum runs inside other libraries' machinery, as transformers keeps
`integrations/`.

- `trl/`: what the mixin does over each TRL trainer (the unit of its batches, its refusals, GRPO's window built
  from generations, DPO's sft term, the MoE router loss);
- `engines/`: the engine seam, one process, DDP, FSDP2 and DeepSpeed behind one small protocol.

Imports the planning wing and everything below it; the faces (`trainer/`, `trl.py`, `args.py`) import it.
"""
