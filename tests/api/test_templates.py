"""Synthesis templates render within limits: a template that would build a huge string, loop
without end or recurse forever fails in a moment with SpecError naming the row and the
template field, `specq synth check` says so on one line (exit 2), and nothing is
submitted. Generated templates and spec values never end in anything but a SpecError."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from specq.api import cli, synthesis
from specq.api.synthesis import SpecError, load_spec
from specq.api.templates import BoundedSandbox, RenderLimits, TemplateLimit
from specq.configs.settings import get_settings
from specq.db.models import Job
from tests.api.conftest import spec_file
from tests.conftest import DERANDOMIZE

HOSTILE = [
    ("{{ 'x' * 30000000 }}", "builds a string of more than 100000 characters"),
    ("{{ topic * 30000000 }}", "builds a string of more than 100000 characters"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "more than 1000000 loop turns"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
     "rendered output exceeds 100000 characters"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion too deep"),
    ("{% for x in [1] recursive %}{{ loop([x]) }}{% endfor %}", "recursion too deep"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}{{ ns.s|length }}", "builds a string of more than"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s %}{{ ns.s }}{{ ns.s }}"
     "{% endset %}{% endfor %}{{ ns.s|length }}", "builds a string of more than"),
    ("{% macro d(s, n) %}{% if n %}{{ d(s + s, n - 1) }}{% else %}{{ s|length }}{% endif %}"
     "{% endmacro %}{{ d('x', 64) }}", "builds a string of more than"),
    ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}"
     "{% endfor %}{{ ns.l|length }}", "collection of more than"),
    ("{{ 'x'|center(1000000000) }}", "builds a string"),
    ("{{ 'x'.ljust(1000000000) }}", "builds a string"),
    ("{{ '{:>1000000000}'.format(1) }}", "format width"),
    ("{{ '%1000000000d' % 1 }}", "format width"),
    ("{{ '%(a)1000000000d'|format(a=1) }}", "format width"),
    ("{% set s = 'x' * 50000 %}{{ ([s] * 100000)|join|length }}", "builds a string"),
    ("{% set s = 'x' * 50000 %}{{ s|replace('', s)|length }}", "builds a string"),
    ("{{ 10 ** 100000000 }}", "number of more than"),
    ("{{ lipsum(n=1000000) }}", "lipsum of more than"),
    ("{{ (1).to_bytes(1000000000, 'big')|length }}", "builds bytes"),
    ("{{ [1]|batch(1000000000, 'x')|list|length }}", "batch into more than"),
    ("{{ 10 ** 5000 }}", "ValueError: Exceeds the limit"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ topic + 1 }}", "TypeError"),
    ("{{ topic.__class__ }}", "unsafe"),
    ("{% set l = [] %}{{ l.append(1) }}", "unsafe"),
    ("{{ topic ", "unexpected end of template"),
    ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "recursion too deep"),
]


@pytest.mark.parametrize("template, message", HOSTILE)
def test_a_hostile_template_fails_fast_naming_row_and_field(tmp_path, template, message):
    # the limit under test is the only one that can fire: the time limit is raised out of
    # the way, so a busy machine cannot stop a render before its loop or size limit does
    t0 = time.perf_counter()
    with pytest.raises(SpecError) as err:
        load_spec(spec_file(tmp_path, template=template, limits={"seconds": 600}))
    assert time.perf_counter() - t0 < 120  # a ceiling against a hang, not a speed test
    problem = err.value.problems[0]
    assert message in problem and "template: " in problem, problem
    assert "\n" not in problem and len(problem) < 600
    if "unexpected end" not in message and "(((" not in template:  # compiling fails
        assert "template: row 0: " in problem


def test_synth_check_prints_one_line_and_submits_nothing(tmp_path, capsys, monkeypatch,
                                                         data_dir):
    db = tmp_path / "synth.db"
    monkeypatch.setenv("SPECQ_DATABASE_URL", f"sqlite:///{db}")
    monkeypatch.setenv("SPECQ_DATA_DIR", str(data_dir))
    get_settings.cache_clear()
    try:
        for template, _ in HOSTILE[:6]:
            path = spec_file(tmp_path, template=template)
            for argv in (["synth", "check", path], ["synth", "run", path]):
                capsys.readouterr()
                assert cli.main(argv) == 2
                err = capsys.readouterr().err
                assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
                assert err.startswith(f"error: invalid synthesis spec: {path}: template: row 0")
        # rows whose prompts the model cannot take: check finds what run would refuse,
        # each seed row named once (its n samples share the text)
        capsys.readouterr()
        assert cli.main(["synth", "check", too_long(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert "template: row 1: prompt: at least 3000 tokens, the model's context is " \
            "512" in err, err
        capsys.readouterr()  # a directory is not a missing file
        assert cli.main(["synth", "check", str(tmp_path)]) == 2
        assert f"{tmp_path}: a directory, not a spec file" in capsys.readouterr().err
        # a pair no preset names: check says so, as run would, not "valid"
        path = spec_file(tmp_path, pair="nope")
        capsys.readouterr()
        assert cli.main(["synth", "check", path]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: invalid synthesis spec: {path}: pair: unknown pair "
                              f"'nope'; known: "), err
    finally:
        get_settings.cache_clear()
    assert not db.exists() or jobs(f"sqlite:///{db}") == 0


def too_long(tmp_path) -> str:
    """A spec whose second seed row renders a prompt past the tiny pair's context."""
    return spec_file(tmp_path, template="{% if topic == 'bread' %}{{ 'word ' * 3000 }}"
                                        "{% else %}About {{ topic }}{% endif %}")


def test_run_names_the_row_whose_prompt_the_model_cannot_take(db_client, tmp_path):
    """What the job's submit refuses ('prompt 4: ...') is said of the template's seed row,
    once for its n samples, and nothing is stored."""
    before = jobs(db_client.settings.sqlalchemy_url)
    with pytest.raises(SpecError) as err:
        synthesis.submit(db_client, load_spec(too_long(tmp_path)))
    (problem,) = err.value.problems
    assert problem.startswith("spec: template: row 1: prompt: at least 3000 tokens"), problem
    assert jobs(db_client.settings.sqlalchemy_url) == before  # (others' jobs may share it)


def jobs(url: str) -> int:
    from specq.db.session import session_factory

    with session_factory(url)() as s:
        return s.scalar(select(func.count()).select_from(Job))


def test_limits_are_the_spec_s_to_set(tmp_path):
    eleven = "{{ 'x' * 11 }}"
    with pytest.raises(SpecError, match=r"row 0: builds a string of more than 10 char|"
                                        r"row 0: rendered output exceeds 10 char"):
        load_spec(spec_file(tmp_path, template=eleven, limits={"max_chars": 10}))
    assert load_spec(spec_file(tmp_path, template=eleven, limits={"max_chars": 11}))
    loops = "{% for i in range(10) %}{% for j in range(10) %}{% endfor %}{% endfor %}"
    with pytest.raises(SpecError, match="more than 50 loop turns"):
        load_spec(spec_file(tmp_path, template=loops, limits={"loop_turns": 50}))
    slow = "{% for i in range(100000) %}{{ range(100000)|sort|first }}{% endfor %}"
    t0 = time.perf_counter()
    with pytest.raises(SpecError, match=r"row 0: rendering took more than 0.3 s"):
        load_spec(spec_file(tmp_path, template=slow, limits={"seconds": 0.3}))
    assert time.perf_counter() - t0 < 120  # a ceiling against a hang, not a speed test
    for bad in ({"max_chars": 0}, {"seconds": float("nan")}, {"loop_turns": True},
                {"seconds": -1}, {"colour": 1}):
        with pytest.raises(SpecError, match="limits"):
            load_spec(spec_file(tmp_path, limits=bad))


def test_the_sandbox_still_renders_ordinary_templates():
    sandbox = BoundedSandbox(RenderLimits(seconds=600))  # only the loop limit can fire
    template = sandbox.compile_template(
        "{{ topic|title }}: {% for w in words %}{{ loop.index }}={{ w ~ '!' }}"
        "{% if not loop.last %}, {% endif %}{% endfor %} {{ '%-4s|' % 'ab' }}"
        "{{ '{:>3}'.format(7) }} {{ [1, 2] + [3] }} {{ 'ab' * 2 }} {{ 2 ** 10 }}"
        "{% set ns = namespace(n=0) %}{% for i in range(5) %}{% set ns.n = ns.n + i %}"
        "{% endfor %} {{ ns.n }} {{ words|join('/') }} {{ 'x'|center(5) }}|")
    assert sandbox.render(template, {"topic": "tides", "words": ["a", "b"]}) == \
        "Tides: 1=a!, 2=b! ab  |  7 [1, 2, 3] abab 1024 10 a/b   x  |"
    with pytest.raises(TemplateLimit, match="loop turns"):
        sandbox.render(sandbox.compile_template(
            "{% for i in range(100000) %}{% for j in range(100) %}{% endfor %}{% endfor %}"),
            {})


TEMPLATE_TEXT = st.text(alphabet="{}%#()[]*~|.,:'\"=+-/ \nabcdefgijklmnoprstux0123456789_",
                        max_size=40)
JINJA_PIECES = st.lists(st.sampled_from([
    "{{ topic }}", "{{ ", " }}", "{% for i in range(", ") %}", "{% endfor %}", "{% if ",
    "{% endif %}", "{% set x = ", "{% macro m(a) %}", "{% endmacro %}", "{{ m(", "loop.index",
    " * 100000", " ~ ", " ** 99", "|center(", "|join", "|replace('', ", "'x'", "topic", "9" * 7,
    "range(100000)", "[1, 2]", "lipsum(", "namespace(", "{% set ns.s = ", "'{:>99}'.format(",
    "%", "|format(", "(", ")", ",", "{{ 1 / 0 }}", "__class__", "{% raw %}", "{% endraw %}",
]), max_size=12).map("".join)


@settings(max_examples=int(os.environ.get("BAD_INPUT_EXAMPLES", 150)), deadline=None,
          derandomize=DERANDOMIZE,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(template=TEMPLATE_TEXT | JINJA_PIECES)
def test_any_template_renders_or_fails_with_a_spec_error(tmp_path, template):
    t0 = time.perf_counter()
    try:
        spec = load_spec(spec_file(tmp_path, template=template or "x",
                                   limits={"seconds": 1.0}))
    except SpecError as exc:
        assert all("\n" not in p and p.isprintable() for p in exc.problems), exc.problems
    else:
        assert all(len(r["prompt"]) <= 100_000 for r in synthesis.requests(spec))
    assert time.perf_counter() - t0 < 120  # a ceiling against a hang, not a speed test


SPEC_FIELDS = {
    "name": st.just("") | st.text(min_size=201, max_size=210) | st.integers() | st.just(None),
    "pair": st.just("") | st.integers() | st.lists(st.text(), max_size=1),
    "seed_data": st.integers() | st.just("missing.jsonl") | st.lists(st.integers(), min_size=1),
    "template": st.just("") | st.integers() | st.just("x" * 100_001),
    "chat": st.text(min_size=1) | st.integers(),
    "n": st.integers(max_value=0) | st.integers(min_value=100_001) | st.floats() | st.text(),
    "sampling": st.just({"temperature": float("nan")}) | st.just({"seed": 1})
    | st.just({"top_k": -1}) | st.just({1: 2}) | st.integers(),
    "seed": st.integers(max_value=-1) | st.integers(min_value=2**63) | st.floats(),
    "output": st.just({"path": "x.txt"}) | st.just({"path": "{nope}.jsonl"})
    | st.just({"path": "{name.__class__}.jsonl"}) | st.just({"path": "{job_id:>999999999}.jsonl"})
    | st.integers() | st.just({"path": "/etc/passwd/x.jsonl"}),
    "chunk_size": st.integers(max_value=0) | st.integers(min_value=2**31) | st.booleans(),
    "limits": st.integers() | st.just({"seconds": 0}) | st.just({"max_chars": 10**9}),
}


@settings(max_examples=int(os.environ.get("BAD_INPUT_EXAMPLES", 100)), deadline=None,
          derandomize=DERANDOMIZE,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(sorted(SPEC_FIELDS)).flatmap(
    lambda f: st.tuples(st.just(f), SPEC_FIELDS[f])))
def test_a_bad_spec_field_is_named(tmp_path, case):
    field, value = case
    with pytest.raises(SpecError) as err:
        load_spec(spec_file(tmp_path, **{field: value}))
    assert any(field in p for p in err.value.problems), (field, err.value.problems)
    assert all("\n" not in p for p in err.value.problems)


@pytest.mark.parametrize("content, message", [
    (b'{"topic": "a"}\n{"topic": \n', "seed_data: line 2: not valid JSON"),
    (b'{"topic": "a"}\n{"topic": "\xff"}\n', "seed_data: line 2: not valid UTF-8"),
    (b'{"topic": "a"}\n[1, 2]\n', "seed_data: line 2: expected an object"),
])
def test_bad_seed_lines_are_named(tmp_path, content, message):
    path = spec_file(tmp_path)
    (tmp_path / "seeds.jsonl").write_bytes(content)
    with pytest.raises(SpecError, match=message):
        load_spec(path)


def test_bad_csv_seeds_are_named(tmp_path):
    (tmp_path / "s.csv").write_text("topic\ncats\ndogs,extra\n")
    with pytest.raises(SpecError, match="seed_data: line 3: more fields than the header"):
        load_spec(spec_file(tmp_path, seed_data="s.csv"))
    # a short row rendered its missing column as "None"; a header naming a column twice
    # kept the last value
    (tmp_path / "s.csv").write_text("topic,x\ncats,1\ndogs\n")
    with pytest.raises(SpecError, match="seed_data: line 3: fewer fields than the header"):
        load_spec(spec_file(tmp_path, seed_data="s.csv"))
    (tmp_path / "s.csv").write_text("topic,topic\ncats,dogs\n")
    with pytest.raises(SpecError, match="seed_data: line 1: the header names 'topic' twice"):
        load_spec(spec_file(tmp_path, seed_data="s.csv"))
    (tmp_path / "s.csv").write_text("topic\ncats\nca\x00ts\n")
    with pytest.raises(SpecError, match=r"template: row 1: the rendered text contains a NUL"):
        load_spec(spec_file(tmp_path, seed_data="s.csv"))
    (tmp_path / "s.csv").write_text("topic\n\n \n")
    with pytest.raises(SpecError, match=r"template: row 0: the rendered text is empty"):
        load_spec(spec_file(tmp_path, seed_data="s.csv", template="{{ topic }}"))


def test_unreadable_spec_files(tmp_path):
    path = tmp_path / "spec.yaml"
    for content, message in [(b"name: \xff\n", "not valid UTF-8"), (b"[" * 10000, "YAML"),
                             (b"a: [1\n", "not valid YAML"), (b"- 1\n", "expected a mapping")]:
        path.write_bytes(content)
        with pytest.raises(SpecError, match=message):
            load_spec(path)
