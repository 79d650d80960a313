"""The sides of the architecture, read from the source files (not from an install): each
room imports only the rooms below it, no module imports itself round a circle, and nothing
names a module by an old path.

    client side   api/          Python client, CLI, formats, inputs, synthesis, report, beat
    queue side    broker/       the Celery app, queue names, sending chunks, the reconciler
    worker side   worker/       the task, its keeper, fault handling, pair loading
    engine        worker/engine the speculative engine: no Celery, SQL or HTTP inside
    storage       db/           models, migrations, repository, chunk bookkeeping, views
    schema        configs/, schema/   settings and presets; requests and counters
    bench         bench/        benchmarks and fault tools (not imported by the product)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# room -> the rooms it may import (besides itself)
ALLOWED = {
    "schema": set(),
    "configs": {"schema"},
    "db": {"configs", "schema"},
    "broker": {"db", "configs", "schema"},
    "worker.engine": {"schema"},
    "worker": {"worker.engine", "broker", "db", "configs", "schema"},
    "api": {"broker", "db", "configs", "schema"},
    "bench": {"api", "broker", "worker", "worker.engine", "db", "configs", "schema"},
}
# The command line is every side's door: `specq worker`, `specq run` and `specq bench` import
# the worker side or a bench inside the command that runs it, never at import.
DOORS = {"api/cli.py": {"worker", "bench"}}
ROOMS = sorted(ALLOWED, key=len, reverse=True)  # worker.engine before worker


def room(module: str) -> str | None:
    name = module.removeprefix("specq.")
    return next((r for r in ROOMS if name == r or name.startswith(r + ".")), None)


def sources() -> list[Path]:
    return [p for top in ("api", "broker", "worker", "db", "configs", "schema", "bench")
            for p in (ROOT / top).rglob("*.py") if "migrations" not in p.parts]


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, the names of `from X import a, b` as
    X.a and X.b too (a module imported by name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def test_no_arrow_points_up_the_layers():
    wrong = []
    for path in sources():
        rel = path.relative_to(ROOT).as_posix()
        here = room("specq." + rel.removesuffix(".py").replace("/", "."))
        may = ALLOWED[here] | DOORS.get(rel, set())
        for line, module in imports(path):
            there = room(module) if module.startswith("specq.") else None
            if there and there != here and there not in may:
                wrong.append(f"{rel}:{line}: {here} imports {module} ({there})")
    assert not wrong, "\n".join(wrong)


def module_of(path: Path) -> str:
    """specq.<room>... of a source file (a package's __init__.py: the package)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("specq",) + parts[: -1 if parts[-1] == "__init__" else None])


def module_level_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of the imports a module runs as it loads, and those under
    ``if TYPE_CHECKING:``; not those inside a function (``imports`` for naming)."""
    found: list[tuple[int, str]] = []
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found += imports_of(node)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            body += [n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)]
    return found


def imports_of(node: ast.Import | ast.ImportFrom) -> list[tuple[int, str]]:
    if isinstance(node, ast.Import):
        return [(node.lineno, a.name) for a in node.names]
    if not node.module or node.level:
        return []
    return [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}")
                                           for a in node.names]


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module of the package it imports at module level: line}. An import
    names the module it loads (``from specq.x import y``: specq.x, and specq.x.y where y
    is a module)."""
    paths = {module_of(p): p for p in sources()}
    graph: dict[str, dict[str, int]] = {}
    for name, path in paths.items():
        found = module_level_imports(ast.parse(path.read_text()))
        graph[name] = {m: line for line, m in sorted(found, reverse=True)
                       if m in paths and m != name}
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle through each set of modules that import each other round (a depth-first
    search: an edge back to a module still open closes one)."""
    found, state = [], dict.fromkeys(graph, "new")
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            if state[n] == "open":
                found.append(path[path.index(n):] + [n])
            elif state[n] == "new":
                visit(n)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if state[m] == "new":
            visit(m)
    return found


def test_no_module_imports_itself_round_a_circle():
    """A circle's modules can be read, tested or changed only together, and its import
    order decides what works. Imports under ``if TYPE_CHECKING:`` count: they are the
    same dependency, named for mypy instead of the interpreter (the way out is a Protocol
    where the type is used, or the shared record in a module of its own, e.g.
    worker/engine/step.py). Imports inside a function do not: they run when it runs, and
    the package keeps them for its doors and its heavy libraries (the CLI loading the
    worker side, llguidance on the first grammar); the layers test still bounds them."""
    graph = import_graph()
    wrong = [" -> ".join(f"{a} ({graph[a][b]})" for a, b in zip(c, c[1:])) + f" -> {c[-1]}"
             for c in circles(graph)]
    assert not wrong, "\n".join(wrong)


def test_the_circle_finder_finds_circles_through_type_only_imports():
    """The test above could pass by finding nothing: a circle it must see."""
    tree = ast.parse("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from specq.b import B\n"
                     "def f():\n    from specq.c import C\n")
    assert sorted(m for _, m in module_level_imports(tree)) == [
        "specq.b", "specq.b.B", "typing", "typing.TYPE_CHECKING"]
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert circles(graph) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b": 1}, "b": {}, "c": {"b": 2}}) == []
    assert len(import_graph()) > 100  # the package's modules, read from the tree


def test_the_engine_holds_no_queue_database_or_server():
    banned = ("celery", "kombu", "redis", "sqlalchemy", "fastapi", "starlette", "uvicorn")
    wrong = [f"{p.relative_to(ROOT)}:{line}: {m}"
             for p in (ROOT / "worker" / "engine").rglob("*.py")
             for line, m in imports(p) if m.split(".")[0] in banned]
    assert not wrong, "\n".join(wrong)


OLD = re.compile(r"(?<![\w.])(?:python -m |\"-m\", \"|-A |from |import )"
                 r"(api|broker|worker|db|configs|schema|bench)\.(?!py\b)\w")


@pytest.mark.parametrize("top", ["api", "broker", "worker", "db", "configs", "schema", "bench",
                                 "tests", "docs", "src"])
def test_nothing_names_a_module_by_its_folder(top):
    """Every module is specq.<room>...: `python -m worker.bench` or `from api.client
    import` would load a second copy of a module (the repository root is on the path of
    an editable install) or fail elsewhere."""
    files = [p for p in (ROOT / top).rglob("*")
             if p.suffix in (".py", ".md") and p != Path(__file__).resolve()]
    files += [ROOT / n for n in ("README.md", "Makefile", "Dockerfile", "docker-compose.yml")
              if top == "docs"]
    wrong = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in files
             for n, line in enumerate(p.read_text().splitlines(), 1) if OLD.search(line)]
    assert not wrong, "\n".join(wrong)
