"""The window engine: one accumulation window (the per-rank batches of one optimizer step) run as forwards of
whatever size memory allows, each scaled to its exact share of the window loss. It knows no `Trainer`.

- `engine.py`: `WindowEngine`, the runner (begin, step, finish), OOM re-cuts included;
- `units.py`: what one unit of a batch is (padded row, padding-free sequence, DPO pair) and how a batch is cut
  into chunks of whole units; `cuts.py`: the arithmetic of a cut (forwards for a size, near-equal sizes);
- `loss.py`: the exact normalization's invariant and label counting; `token_budget.py`: cutting by tokens;
- `protocol.py`: how the data-parallel ranks of one window agree (explicit state, an injected collective);
- `evaluation.py`: evaluation as a window (an exact eval_loss, OOM re-runs of one batch);
- `oom.py`: the one place that decides whether an exception is an out-of-memory error.

Imports only `config/` and `compat/`; the trainer, the TRL integration, `loop.py`, the probe and the planner import it.
"""
