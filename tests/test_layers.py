"""The house's layers: every import inside hf_accum/ runs down the layer order docs/development.md writes (its
`<!-- layers -->` block, read here, so the page and the test cannot drift), never up, and no modules import each
other in a circle. Lazy imports inside functions are imports too: they are read from the whole syntax tree."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_accum"


def written_layers() -> list[str]:
    """The top-level entries of hf_accum/, top floor first, as docs/development.md lists them."""
    page = (ROOT / "docs" / "development.md").read_text()
    block = re.search(r"<!-- layers -->\s*```text\n(.*?)```", page, re.S)
    assert block, "docs/development.md has no <!-- layers --> block"
    return [line.split()[0].rstrip("/").removesuffix(".py") for line in block.group(1).splitlines()
            if line.strip() and not line.startswith(" ")]


def module_name(path: Path, package: Path) -> str:
    return ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")


def import_graph(package: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module of ours: line}, relative and absolute imports alike, at any depth of the file."""
    files = sorted(package.rglob("*.py"))
    modules = {module_name(p, package) for p in files}
    graph = {}
    for path in files:
        me = module_name(path, package)
        here = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
        found = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    target = next((m for m in (f"{base}.{alias.name}", base) if m in modules), None)
                    if target and target != me:
                        found.setdefault(target, node.lineno)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.name != me:
                        found.setdefault(alias.name, node.lineno)
        graph[me] = found
    return graph


def entry(module: str) -> str | None:
    """The top-level entry a module belongs to (None: the package's own __init__, the lazy face of every name)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def climbs(graph: dict[str, dict[str, int]], layers: list[str]) -> list[str]:
    floor = {name: i for i, name in enumerate(layers)}
    out = []
    for module, imports in graph.items():
        for target, line in imports.items():
            a, b = entry(module), entry(target)
            if a and b and a != b and floor[a] >= floor[b]:
                out.append(f"{module}:{line} imports {target} ({a} is not above {b})")
    return sorted(out)


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_written_layers_are_the_top_level_entries():
    entries = sorted(p.name.removesuffix(".py") for p in PACKAGE.iterdir()
                     if p.name not in ("__init__.py", "py.typed", "__pycache__"))
    layers = written_layers()
    assert len(layers) == len(set(layers)), layers
    assert sorted(layers) == entries
    assert len(entries) + 1 <= 15  # and the package's __init__.py: a reader's first map


def test_every_import_runs_down_the_layers():
    assert climbs(import_graph(PACKAGE), written_layers()) == []


def test_no_modules_import_each_other_in_a_circle():
    assert circles(import_graph(PACKAGE)) == []


@pytest.mark.parametrize("wing", sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()))
def test_every_wing_says_what_it_holds(wing):
    doc = ast.get_docstring(ast.parse((PACKAGE / wing / "__init__.py").read_text()))
    assert doc and len(doc) > 80, f"hf_accum/{wing}/__init__.py says nothing of what the wing holds"


def test_a_climb_and_a_circle_are_caught(tmp_path):
    """The checks fail where they should: a lower wing importing a higher one (lazily, inside a function), and two
    modules importing each other."""
    package = tmp_path / "hf_accum"
    for name, text in {"__init__.py": "", "low/__init__.py": "", "high/__init__.py": "",
                       "low/a.py": "def f():\n    from ..high import b\n", "high/b.py": "from ..low import c\n",
                       "low/c.py": "from . import d\n", "low/d.py": "from .c import x\n"}.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    graph = import_graph(package)
    assert climbs(graph, ["high", "low"]) == ["hf_accum.low.a:2 imports hf_accum.high.b (low is not above high)"]
    assert circles(graph) == [["hf_accum.low.c", "hf_accum.low.d"]]
