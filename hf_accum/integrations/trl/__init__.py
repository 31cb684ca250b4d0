"""What `AccumulationMixin` needs of TRL's trainers: `support.py` (the unit of each trainer's batches, a plain TRL
config's normalization, the refusals), `adapter.py` (the hooks of a trainer that builds its own batches), `grpo.py`
and `grpo_entropy.py` (GRPO's generation batch as one window), `dpo_sft.py` (DPO's sft term as a token mean),
`router_aux.py` (TRL's MoE router loss inside the window). The `Accum*` classes themselves are `hf_accum/trl.py`."""
