"""The config wing: a run's settings as the code reads them, from whatever arguments object a trainer got
(`settings.Settings`), the value checks behind `AccumTrainingArguments.__post_init__` (`arg_checks`), whether a
directory can be written and the plan file's name (`paths`), and which memory levers a "does not fit" message may
suggest (`fit_hints`).

The bottom wing but one: it imports only `compat/` (lazily), and every other wing may import it. Nothing here
imports torch at module level, so the recipe checks and `hf-accum --help` stay light.
"""
