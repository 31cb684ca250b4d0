"""How many test functions and distinct assertions a tests folder holds (`python scripts/dev/test_census.py tests`):
assert statements plus pytest.raises / pytest.warns calls, counted in the source (a parametrized test counts once).
A change that makes the suite faster prints the same or larger figures before and after (issue 52)."""
import ast
import pathlib
import sys

root = pathlib.Path(sys.argv[1])
tests = asserts = 0
for p in sorted(root.rglob("*.py")):
    tree = ast.parse(p.read_text())
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_"):
            tests += 1
        if isinstance(n, ast.Assert):
            asserts += 1
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("raises", "warns") \
                and isinstance(n.func.value, ast.Name) and n.func.value.id == "pytest":
            asserts += 1
print(f"{root}: test functions {tests}, assertions {asserts}")
