"""Issue 59, item 13: a message may point only to what an installed user has. A wheel ships no docs/ folder and no
README, so no string the library prints names a docs/*.md page or a README section; docstrings and comments (read in
the source tree) may."""

import ast
import pathlib
import re

import hf_accum

PACKAGE = pathlib.Path(hf_accum.__file__).parent
POINTER = re.compile(r"docs/\w+\.md|README")


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def pointers(source: str) -> list[str]:
    tree = ast.parse(source)
    skip = _docstrings(tree)
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in skip and POINTER.search(node.value)]


def test_the_check_finds_a_pointer_in_a_message_and_not_in_a_docstring():
    assert pointers('def f():\n    """see docs/plan.md"""\n    raise ValueError("see docs/plan.md")\n') == \
        ["see docs/plan.md"]


def test_no_message_points_to_a_file_a_wheel_does_not_ship():
    found = {str(path.relative_to(PACKAGE)): hits for path in sorted(PACKAGE.rglob("*.py"))
             if (hits := pointers(path.read_text()))}
    assert found == {}
