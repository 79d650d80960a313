"""Synthesis specs: seeds, rendering, seed formats, and bad specs failing with the field's
name before anything is submitted (on SQLite and PostgreSQL)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from sqlalchemy import func, select

from specq.api import synthesis
from specq.api.synthesis import SpecError, load_spec, requests, sample_seed
from specq.configs.schedules import ScheduleError, load_schedules
from specq.db.models import Job
from tests.api.conftest import spec_file


def jobs_count(client) -> int:
    with client.sessions() as s:
        return s.scalar(select(func.count()).select_from(Job))


@pytest.mark.parametrize("over,field", [
    ({"template": "About {{ topic }} for {{ audience }}"}, "template: row 0: 'audience' is"),
    ({"seed_data": "missing.jsonl"}, "seed_data: file not found: missing.jsonl"),
    ({"n": 0}, "n: Input should be greater than or equal to 1"),
    ({"template": "About {{ topic "}, "template: "),
    ({"sampling": {"temperature": -1}}, "sampling"),
    ({"output": {"path": "out.txt"}}, "output.format"),
    ({"colour": "red"}, "colour: Extra inputs are not permitted"),
])
def test_bad_spec_names_field_and_submits_nothing(db_client, tmp_path, over, field):
    before = jobs_count(db_client)
    with pytest.raises(SpecError) as exc:
        synthesis.submit(db_client, load_spec(spec_file(tmp_path, **over)))
    assert field in str(exc.value)
    assert jobs_count(db_client) == before


def test_missing_column_in_a_later_row(tmp_path):
    path = spec_file(tmp_path)
    (tmp_path / "seeds.jsonl").write_text('{"topic": "a"}\n{"subject": "b"}\n')
    with pytest.raises(SpecError, match=r"template: row 1: 'topic' is undefined.*subject"):
        load_spec(path)


def test_invalid_cron_names_schedule_and_field(tmp_path):
    path = tmp_path / "schedules.yaml"
    path.write_text(yaml.safe_dump({"good": {"spec": "a.yaml", "cron": "*/5 * * * *"},
                                    "bad": {"spec": "a.yaml", "cron": "61 * * * *"},
                                    "short": {"spec": "a.yaml", "cron": "* * *"}}))
    with pytest.raises(ScheduleError) as exc:
        load_schedules(path)
    assert "bad: cron: invalid expression '61 * * * *'" in str(exc.value)
    assert "short: cron: expected 5 fields" in str(exc.value)


def test_builtin_example_and_schedules_are_valid():
    from specq.configs.settings import Settings

    schedules = load_schedules(Settings().schedules_file)
    for s in schedules.values():
        spec = load_spec(s.spec)
        assert spec.n >= 1 and synthesis.check_rows(spec) > 0


def test_requests_and_seeds_are_deterministic(tmp_path):
    spec = load_spec(spec_file(tmp_path, seed=5))
    reqs = list(requests(spec))
    assert [r["custom_id"] for r in reqs] == ["0-0", "0-1", "1-0", "1-1"]
    assert reqs[2]["prompt"] == "About bread"
    assert [r["seed"] for r in reqs] == [sample_seed(5, r, k) for r in (0, 1) for k in (0, 1)]
    assert len({r["seed"] for r in reqs}) == 4 and all(0 <= r["seed"] < 2**63 for r in reqs)
    assert reqs == list(requests(load_spec(spec_file(tmp_path, seed=5))))
    assert reqs[0]["seed"] != list(requests(load_spec(spec_file(tmp_path, seed=6))))[0]["seed"]


def test_sandbox_refuses_unsafe_templates(tmp_path):
    with pytest.raises(SpecError, match="template: row 0"):
        load_spec(spec_file(tmp_path, template="{{ topic.__class__.__mro__ }}"))


def test_seed_formats(tmp_path):
    (tmp_path / "s.csv").write_text("topic,n\ncats,1\ndogs,2\n")
    (tmp_path / "bom.csv").write_text("\ufefftopic,n\r\nbats,1\r\n")  # as Excel saves it
    pq.write_table(pa.table({"topic": ["owls"], "n": [3]}), tmp_path / "s.parquet")
    for name, first in [("s.csv", "About cats"), ("bom.csv", "About bats"),
                        ("s.parquet", "About owls")]:
        spec = load_spec(spec_file(tmp_path, seed_data=name))
        assert next(requests(spec))["prompt"] == first
    inline = load_spec(spec_file(tmp_path, seed_data=[{"topic": "x"}], chat=True))
    assert next(requests(inline))["messages"] == [{"role": "user", "content": "About x"}]


def test_every_path_a_spec_names_is_relative_to_the_spec(tmp_path, monkeypatch):
    """seed_data and output.path are taken from the spec's directory whatever the working
    directory; {data_dir} is the data directory of the settings that load it."""
    folder = tmp_path / "specs"
    folder.mkdir()
    path = spec_file(folder, output={"path": "out/{name}-{job_id}.jsonl"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = load_spec(path)
    assert spec.seed_data == str(folder / "seeds.jsonl")
    assert synthesis.output_path(spec, 7) == folder / "out" / "t-7.jsonl"
    data = tmp_path / "da{ta}"
    spec = load_spec(spec_file(folder, output={"path": "{data_dir}/synth/{job_id}.parquet"}),
                     data_dir=data)
    assert synthesis.output_path(spec, 3) == data / "synth" / "3.parquet"


def test_the_docs_list_the_data_sets_columns_as_written():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "synthesis.md").read_text()
    listed = text[text.index("then, in this order,"):text.index("(`api/synthesis.py: SAMPLE")]
    assert re.findall(r"`([a-z_]+)`", listed) == list(synthesis.SAMPLE_COLUMNS)
