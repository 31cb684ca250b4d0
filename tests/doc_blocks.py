"""The code blocks of a Markdown page (README.md, docs/*.md) and how to run them as written.

A block runs unless the line right above its fence is `<!-- skip (KIND): REASON -->`, KIND one of `SKIP_KINDS`:
then its test is skipped with that reason. Python blocks run in this process (a fresh namespace, in a temporary
directory); shell blocks run in bash with `set -euo pipefail`, with this checkout's hf_accum first on the path and
the interpreter's `hf-accum` on PATH, offline. A shell block whose every line is a plain `hf-accum` command (words
bash passes on as they are: no quotes, variables, globs, pipes or redirections) or `python -c` with one quoted
program bash leaves as it is runs each line as written in this process instead (`in_process_lines`,
`run_in_process`): through the CLI's `main`, or as `python -c` runs its program, in the same environment, stopping
at the first failure as `set -e` does. A fresh interpreter costs ~10 s of imports per line, and the process is not
what these blocks show (the tests of tests/cli launch the console script where it is)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNABLE = {"python": "python", "bash": "shell", "sh": "shell", "shell": "shell"}
SKIP_KINDS = ("gpu", "hub", "long", "install", "multi-process")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
SKIP = re.compile(r"<!-- skip \(([\w-]+)\): (.+?) -->")


@dataclass
class Block:
    page: str  # relative to ROOT
    line: int
    kind: str  # "python" or "shell"
    code: str
    skip: tuple[str, str] | None  # (kind, reason)
    section: str = ""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass
class Ran:
    output: str
    namespace: dict = field(default_factory=dict)


def pages() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return sorted(f"docs/{name}" for name in os.listdir(docs) if name.endswith(".md") and not name.startswith("_"))


def read(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def blocks(page: str) -> list[Block]:
    text = read(page)
    found = []
    for match in FENCE.finditer(text):
        kind = RUNNABLE.get(match.group(1))
        if kind is None:
            continue
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.fullmatch(before.strip())
        headings = re.findall(r"^#+ (.+)$", text[: match.start()], re.M)
        found.append(Block(page, text.count("\n", 0, match.start()) + 1, kind, match.group(2),
                           (skip.group(1), skip.group(2)) if skip else None, headings[-1] if headings else ""))
    return found


# What every block runs under, in bash or in this process.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "Agg"}


def shell_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""), **OFFLINE}


def run_shell(code: str, cwd: str, timeout: int = 600) -> Ran:
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=shell_env(), capture_output=True,
                          text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"exit {done.returncode}:\n{output[-4000:]}"
    return Ran(output)


# A word bash passes on unchanged: no quote, escape, variable, glob, tilde, comment, pipe, redirection or separator.
_PLAIN_WORD = re.compile(r"[\w.,=/:+@%-]+")


def in_process_lines(code: str) -> list[tuple[str, list[str] | str]] | None:
    """Each line of ``code`` as ("hf-accum", argv) or ("python", source) when every line is `hf-accum` followed by
    plain words or `python -c` with one quoted program that bash passes on as written (no variable, command
    substitution or escape: bash would change those inside double quotes); None otherwise: the block runs in bash."""
    lines = []
    for line in code.splitlines():
        if not line.strip():
            continue
        words = line.split()
        if words[0] == "hf-accum" and all(_PLAIN_WORD.fullmatch(w) for w in words):
            lines.append(("hf-accum", words[1:]))
        elif words[:2] == ["python", "-c"] and not re.search(r"[$`\\]", line) and len(shlex.split(line)) == 3:
            lines.append(("python", shlex.split(line)[2]))
        else:
            return None
    return lines or None


def run_in_process(lines: list[tuple[str, list[str] | str]], capsys, monkeypatch) -> Ran:
    """Each line in order in this process, in the environment `run_shell` gives bash: an `hf-accum` line through
    `hf_accum.cli.main`, a `python -c` program as `python -c` runs it (a fresh ``__main__`` namespace, ``sys.argv``
    ``['-c']``). The first line that fails ends the block as `set -e` does; what the lines print is joined as bash's
    is (every line's stdout, then every line's stderr)."""
    from hf_accum.cli import main

    for name, value in OFFLINE.items():  # (this process already imports this checkout's hf_accum: no PYTHONPATH)
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["-c"])
    capsys.readouterr()
    outs, errs = [], []
    for kind, what in lines:
        try:
            if kind == "hf-accum":
                status = main(what)
            else:  # an exception fails the test here, as its non-zero exit failed the block in bash
                exec(compile(what, "<string>", "exec"), {"__name__": "__main__"})
                status = 0
        except SystemExit as exc:  # --help and --version exit as the console script does
            status = exc.code
        captured = capsys.readouterr()
        outs.append(captured.out)
        errs.append(captured.err)
        output = "".join(outs) + "".join(errs)
        assert status in (0, None), f"{kind} {what}: exit {status}:\n{output[-4000:]}"
    return Ran("".join(outs) + "".join(errs))


def run_python(code: str, capsys) -> Ran:
    namespace: dict = {"__name__": "__main__"}
    exec(compile(code, "<docs block>", "exec"), namespace)
    return Ran(capsys.readouterr().out, namespace)
