"""The planning wing: measure -> plan, and the one writer of plan state (`planner.Planner`).

`tuning.py` runs the probe on the trainer's own data (`data_scan.py` picks the worst-case batch, `tokens.py` the
token budget's second length, `eval_batch.py` the evaluation batch) and turns what it measured into the plan;
`planner.py` applies it and is the only writer of the batch settings it implies (`rows.py` lends the plan's rows to
TRL for one block); `policy.py` says what the plan becomes after an out-of-memory error and `growback.py` when it
returns; `store.py` is the plan file. Imports the probing wing and those below it (levers, window, config,
compat); the trainer, the TRL integration and the recipes import it.
"""
