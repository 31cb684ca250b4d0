"""The swap harnesses in scripts/swap/ imported as modules by their tests (the folder is not a package; a harness
imports the one beside it, so the folder is on sys.path while it loads)."""

import importlib
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts" / "swap"


def load(name: str):
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPTS))
