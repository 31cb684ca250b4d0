"""MkDocs hooks (mkdocs.yml `hooks:`): pages that cannot go stale because the build writes them from the code.

- `<!-- cli-help: ARGS -->` becomes the output of `hf-accum ARGS --help` (the argparse text users see, 100 columns);
- `<!-- arguments-table -->` becomes a table of the fields AccumTrainingArguments adds to TrainingArguments, with
  their defaults and the help text `HfArgumentParser` shows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re

import hf_accum  # noqa: F401 - before transformers: it drops other libraries' noise printed on import

_CLI = re.compile(r"<!-- cli-help: ?([\w -]*) -->")


def _help(words: str) -> str:
    from hf_accum.cli import main

    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal; a fixed width keeps the page stable
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*words.split(), "--help"])
    return f"```text\n{out.getvalue().rstrip()}\n```"


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _arguments_table() -> str:
    from transformers import TrainingArguments

    from hf_accum.args import AccumTrainingArguments

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    rows = ["| argument | default | what it does |", "|---|---|---|"]
    for f in dataclasses.fields(AccumTrainingArguments):
        if f.name in base or not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append(f"| `{f.name}` | `{_cell(repr(default))}` | {_cell(f.metadata.get('help', ''))} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = _CLI.sub(lambda m: _help(m.group(1)), markdown)
    if "<!-- arguments-table -->" in markdown:
        markdown = markdown.replace("<!-- arguments-table -->", _arguments_table())
    return markdown
