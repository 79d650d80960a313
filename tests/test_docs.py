"""README.md and docs/*.md stay true where a machine can tell: every relative link reaches
a file and, with #anchor, one of its headings; every `specq` command, flag and `make`
target they show exists; every `python -m` module they show is there and takes the flags
shown. (docs/database.md's columns and queries: tests/db/test_docs.py.)"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from specq.api import cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]+\]\(([^)\s]+)\)")


def name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def prose(text: str) -> str:
    """The text without code blocks and inline code (where [x](y) is not a link)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated one numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links() -> list[tuple[str, str]]:
    return [(name(page), target) for page in PAGES
            for target in LINK.findall(prose(page.read_text()))
            if not re.match(r"[a-z]+:", target)]  # http:, https:, mailto: are not ours


CODE_ROOMS = ("api", "broker", "worker", "db", "configs", "schema", "bench")
CODE_LINK = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+))?")


def test_every_page_and_heading_the_code_points_to_exists():
    """A comment that keeps only why and sends the reader to the figures
    (`docs/benchmarks.md#2026-12-02-compaction-bar`) reaches the page and its heading."""
    found, wrong = 0, []
    for room in CODE_ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                for page, anchor in CODE_LINK.findall(line):
                    found += 1
                    where = ROOT / "docs" / page
                    if not where.exists():
                        wrong.append(f"{name(path)}:{n}: no page docs/{page}")
                    elif anchor and anchor not in anchors(where):
                        wrong.append(f"{name(path)}:{n}: no heading #{anchor} in docs/{page}")
    assert found, "no pointer into docs/ found in the code: the pattern is wrong"
    assert not wrong, "\n".join(wrong)

def test_the_pages_link_to_each_other():
    """The README reaches every page of docs/ (a page nobody links to is lost)."""
    readme = {t.split("#")[0] for page, t in links() if page == "README.md"}
    pages = {name(p) for p in PAGES if p.parent.name == "docs"}
    assert pages <= readme, f"not linked from README.md: {sorted(pages - readme)}"


@pytest.mark.parametrize(("page", "target"), links())
def test_every_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    where = ((ROOT / page).parent / path).resolve() if path else ROOT / page
    assert where.exists(), f"{page}: {target}: no file {where.relative_to(ROOT)}"
    if anchor:
        assert where.suffix == ".md", f"{page}: {target}: an anchor in a file that is not a page"
        assert anchor in anchors(where), (
            f"{page}: {target}: no heading #{anchor} in {where.relative_to(ROOT)}; "
            f"its headings: {sorted(anchors(where))}")


def shell_lines() -> list[tuple[str, str]]:
    """(page, command line) for every line of every bash block, continuations joined."""
    out = []
    for page in PAGES:
        for lang, body in FENCE.findall(page.read_text()):
            if lang not in ("bash", "sh", ""):
                continue
            for line in body.replace("\\\n", " ").splitlines():
                line = re.split(r"(?:^|\s)#\s", line.strip(), maxsplit=1)[0].strip()
                if line:
                    out.append((name(page), line))
    return out


def words(line: str, program: str) -> list[str] | None:
    """The words after ``program`` on a shell line (after any VAR=value, before a pipe's
    next command or &), or None if the line does not run it."""
    for part in re.split(r"\s[|&;]\s?|\s&$", line):
        try:
            tokens = shlex.split(part)
        except ValueError:  # a here-document's line, not a command
            return None
        while tokens and re.fullmatch(r"\w+=.*", tokens[0]):
            tokens = tokens[1:]
        if tokens and tokens[0] == program:
            return tokens[1:]
    return None


def commands() -> list[tuple[str, list[str]]]:
    return [(page, rest) for page, line in shell_lines()
            if (rest := words(line, "specq")) is not None]


def choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def subparser(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser that reads argv's flags (a HEAVY command's own, as `specq` builds it) and
    the command words that chose it."""
    parser, chosen = cli.parser(), []
    while any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
        word = next((w for w in argv if not w.startswith("-")), None)
        known = choices(parser)
        assert word in known, f"`specq {' '.join(chosen + [str(word)])}`: no such command; " \
                              f"known: {', '.join(known)}"
        parser, chosen = known[word], chosen + [word]
        argv = argv[argv.index(word) + 1:]
    if argv and f"{chosen[0]}-{argv[0]}" in cli.HEAVY:  # `specq bench gpu`: bench-gpu
        chosen, argv = [f"{chosen[0]}-{argv[0]}"], argv[1:]
    if chosen[0] in cli.HEAVY:
        parser = argparse.ArgumentParser(prog=f"specq {chosen[0]}")
        importlib.import_module(cli.HEAVY[chosen[0]][0]).add_arguments(parser)
    return parser, chosen


def flags(argv: list[str]) -> list[str]:
    """The --flags and -f short flags a command line shows ([--a x|y] included)."""
    text = " ".join(argv)
    return re.findall(r"(?<![\w-])(--[a-z][\w-]*|-[a-zA-Z])(?![\w-])", text)


def test_the_docs_show_commands():
    """The parsing below has something to check (a change to the fences would hide them)."""
    shown = {page for page, _ in commands()}
    assert {"README.md", "docs/jobs.md", "docs/operations.md", "docs/benchmarks.md",
            "docs/synthesis.md", "docs/http.md"} <= shown


@pytest.mark.parametrize(("page", "argv"), commands(),
                         ids=[f"{p}:{' '.join(a)[:60]}" for p, a in commands()])
def test_every_specq_command_and_flag_exists(page, argv):
    parser, chosen = subparser(argv)
    known = set(parser._option_string_actions)
    wrong = [f for f in flags(argv) if f not in known]
    assert not wrong, f"{page}: `specq {' '.join(chosen)}` has no {', '.join(wrong)}"


def inline_commands() -> list[tuple[str, str]]:
    return [(name(page), m) for page in PAGES
            for m in re.findall(r"`specq ([a-z][\w-]*(?: [a-z][\w-]*)?)", page.read_text())]


def test_every_specq_command_named_in_the_text_exists():
    top = choices(cli.parser())
    wrong = []
    for page, found in inline_commands():
        first, _, second = found.partition(" ")
        if first not in top:
            wrong.append(f"{page}: `specq {found}`")
        elif second and any(isinstance(a, argparse._SubParsersAction)
                            for a in top[first]._actions) and second not in choices(top[first]):
            wrong.append(f"{page}: `specq {found}`")
    assert not wrong, "\n".join(wrong)


ROOMS = ("api", "broker", "worker", "db", "configs", "schema", "bench", "tests", "docs",
         "examples", "src", ".ci")
PATH = re.compile(r"`((?:" + "|".join(map(re.escape, ROOMS)) + r")/[\w./-]*)(?:: (\w+))?`")


def test_every_file_named_exists():
    """`worker/engine/suffix.py`, `db/models.py: JobStatus`: the file (or folder) is there,
    and the name is defined in it."""
    wrong = []
    for page in PAGES:
        for path, defined in PATH.findall(page.read_text()):
            where = ROOT / path
            if not where.exists():
                wrong.append(f"{name(page)}: {path}: no such file")
            elif defined and not re.search(rf"^\s*(?:class|def) {defined}\b|^{defined} =",
                                          where.read_text(), re.M):
                wrong.append(f"{name(page)}: {path}: {defined} is not defined there")
    assert not wrong, "\n".join(wrong)


class _Built(Exception):
    """Raised in place of parsing: carries the parser a module's main() built."""


def test_every_python_module_shown_exists_and_parses_its_line(monkeypatch):
    """Each `python -m specq....` line is parsed by the module's own parser, as its main()
    builds it (stopped before it runs anything): the flags exist and take those values."""
    shown = [(page, rest) for page, line in shell_lines()
             if (rest := words(line, "python")) and rest[0] == "-m"]
    assert shown

    def built(self, args=None, namespace=None):
        raise _Built(self)

    parse = argparse.ArgumentParser.parse_args
    for page, rest in shown:
        module = rest[1]
        assert module.startswith("specq."), f"{page}: python -m {module}: not specq.<room>..."
        assert importlib.util.find_spec(module), f"{page}: python -m {module}: no such module"
        with monkeypatch.context() as m:
            m.setattr(argparse.ArgumentParser, "parse_args", built)
            with pytest.raises(_Built) as caught:
                importlib.import_module(module).main(rest[2:])
        try:
            parse(caught.value.args[0], rest[2:])
        except SystemExit:
            pytest.fail(f"{page}: `python -m {' '.join(rest[1:])}` does not parse (above)")


def test_every_make_target_shown_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    shown = [(page, rest[0]) for page, line in shell_lines()
             if (rest := words(line, "make"))]
    shown += [(name(p), t) for p in PAGES for t in re.findall(r"`make ([\w-]+)", p.read_text())]
    assert shown
    wrong = [f"{page}: make {t}" for page, t in shown if t not in targets]
    assert not wrong, "\n".join(wrong)


def test_the_settings_table_is_the_settings():
    """docs/configuration.md's table names every setting, and nothing else, with its default
    where the default is a plain value."""
    from specq.configs.settings import Settings

    rows = re.findall(r"^\| (`SPECQ_\w+`(?: / `SPECQ_\w+`)*) \| ([^|]*) \|",
                      (ROOT / "docs" / "configuration.md").read_text(), re.M)
    documented: dict[str, str] = {}
    for names, default in rows:
        found = re.findall(r"`SPECQ_(\w+)`", names)
        values = [v.strip() for v in default.split(" / ")]
        for i, setting in enumerate(found):
            documented[setting.lower()] = values[i] if len(values) == len(found) else ""
    assert set(documented) == set(Settings.model_fields)
    for setting, shown in documented.items():
        default = Settings.model_fields[setting].default
        if isinstance(default, (int, float, str)) and not isinstance(default, bool):
            plain = f"{default:g}" if isinstance(default, float) else str(default)
            assert shown == f"`{plain}`", f"SPECQ_{setting.upper()}: documented {shown}, " \
                                          f"default {default!r}"


def test_the_readme_client_example_names_what_the_client_has():
    """The README's Python example calls only what Client, Job, the items and the metrics
    have (it needs a fleet to run; the names are checked here)."""
    import ast

    from specq.api.client import Client, ItemResult, Job, JobMetrics

    (code,) = [body for lang, body in FENCE.findall((ROOT / "README.md").read_text())
               if lang == "python" and "Client()" in body]
    kinds = {"client": Client, "job": Job, "item": ItemResult}
    used = [(node.value.id, node.attr) for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)]
    assert {name for name, _ in used} >= set(kinds)
    wrong = [f"{name}.{attr}" for name, attr in used
             if name in kinds and not hasattr(kinds[name], attr)
             and attr not in getattr(kinds[name], "__dataclass_fields__", {})]
    assert not wrong, f"README.md: the example uses {', '.join(wrong)}, which do not exist"
    assert hasattr(JobMetrics, "as_dict") and "metrics().as_dict()" in code
