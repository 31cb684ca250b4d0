"""The `hf-accum` console script: `hf-accum probe ...` and `hf-accum train ...`.

Each sub-command owns one `_add_<name>_parser` function (its flags) and one `_run_<name>` function;
`main` only dispatches, so heavy imports (torch, transformers) happen after argument errors are reported.
"""

from __future__ import annotations

import argparse
import sys

from . import __version__


# --- probe -------------------------------------------------------------------------------------------
def _add_probe_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="measure peak memory per micro-batch and print the plan")
    p.set_defaults(func=_run_probe)


def _run_probe(args: argparse.Namespace) -> int:
    raise SystemExit("hf-accum probe: not implemented yet")


# --- train -------------------------------------------------------------------------------------------
def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run a recipe (a name from recipes/ or a YAML path) with key=value overrides")
    p.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    raise SystemExit("hf-accum train: not implemented yet")


# --- dispatch ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-accum", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hf-accum {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{probe,train}")
    _add_probe_parser(sub)
    _add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
