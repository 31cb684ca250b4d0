"""The suite's time per file and its slowest tests, as markdown, from pytest's `--durations=0` report.

    python -m pytest -q -n 2 --dist loadgroup --durations=0 > run.log; python scripts/dev/suite_durations.py run.log

Each test's setup, call and teardown are added up (a module or session fixture's setup counts for the first test that
needs it). With two workers the sum over files is about twice the wall time: it is CPU time spent per file."""

from __future__ import annotations

import argparse
import collections
import re
import sys

LINE = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+)")


def parse(lines) -> dict[str, float]:
    """Seconds per test node id (setup + call + teardown)."""
    per_test: dict[str, float] = collections.defaultdict(float)
    for line in lines:
        m = LINE.match(line.strip())
        if m:
            per_test[m.group(3)] += float(m.group(1))
    return dict(per_test)


def per_file(per_test: dict[str, float]) -> dict[str, float]:
    files: dict[str, float] = collections.defaultdict(float)
    for node, seconds in per_test.items():
        files[node.split("::", 1)[0]] += seconds
    return dict(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="pytest output with --durations=0 ('-' for stdin)")
    parser.add_argument("--top", type=int, default=25, help="how many of the slowest tests (default 25)")
    parser.add_argument("--files", type=int, default=30, help="how many of the slowest files (default 30)")
    args = parser.parse_args(argv)
    text = sys.stdin.read() if args.log == "-" else open(args.log).read()
    tests = parse(text.splitlines())
    if not tests:
        print(f"{args.log}: no durations found (run pytest with --durations=0)", file=sys.stderr)
        return 2
    files = per_file(tests)
    total = sum(tests.values())
    print(f"{len(tests)} tests, {total:.0f} s summed over workers\n")
    print("| file | s | share |\n|---|---:|---:|")
    for name, seconds in sorted(files.items(), key=lambda kv: -kv[1])[: args.files]:
        print(f"| {name} | {seconds:.0f} | {seconds / total:.0%} |")
    print("\n| slowest tests | s |\n|---|---:|")
    for name, seconds in sorted(tests.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"| {name} | {seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
