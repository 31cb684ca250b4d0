"""The code blocks of a Markdown page (README.md, docs/*.md) and how to run them as written.

A block runs unless the line right above its fence is `<!-- skip (KIND): REASON -->`, KIND one of `SKIP_KINDS`:
then its test is skipped with that reason. Python blocks run in this process (a fresh namespace, in a temporary
directory); shell blocks run in bash with `set -euo pipefail`, with this checkout's hf_accum first on the path and
the interpreter's `hf-accum` on PATH, offline."""

from __future__ import annotations

import os
import re
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


def shell_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "Agg"}


def run_shell(code: str, cwd: str, timeout: int = 600) -> Ran:
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=shell_env(), capture_output=True,
                          text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"exit {done.returncode}:\n{output[-4000:]}"
    return Ran(output)


def run_python(code: str, capsys) -> Ran:
    namespace: dict = {"__name__": "__main__"}
    exec(compile(code, "<docs block>", "exec"), namespace)
    return Ran(capsys.readouterr().out, namespace)
