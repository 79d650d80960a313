"""The sides of the architecture, read from the source files (not from an install): each
room imports only the rooms below it, and nothing names a module by an old path.

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
