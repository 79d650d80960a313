"""The `specq` command as people meet it: one format per figure everywhere, counts that keep
cancelled apart, a summary in words, quiet pipes, standard input, help that names the
commands, and database errors that say the next true step."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import uuid

import pytest
from sqlalchemy import select

from specq.api import cli
from specq.api.client import Client
from specq.api.figures import shown
from specq.configs.presets import get_preset
from specq.configs.settings import Settings, get_settings
from specq.db.models import Job
from specq.db.session import migrate
from specq.worker.pairs import load_pair
from specq.worker.tasks import run_inline

PLAIN_PRESET = "tiny-plain:\n  target: {tiny: target}\n  drafter: none\n"


@pytest.fixture
def env(monkeypatch, tmp_path, data_dir):
    """SPECQ_* of a migrated SQLite database in tmp_path, a preset that never drafts, and a
    queue prefix of this test (on Redis database 15)."""
    for key in list(os.environ):
        if key.startswith("SPECQ_"):
            monkeypatch.delenv(key)
    presets = tmp_path / "presets.yaml"
    presets.write_text(PLAIN_PRESET)
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    migrate(url)
    values = {"SPECQ_DATA_DIR": str(data_dir), "SPECQ_DATABASE_URL": url,
              "SPECQ_PRESETS_FILE": str(presets), "SPECQ_BROKER_URL": "redis://127.0.0.1:6379/15",
              "SPECQ_QUEUE_PREFIX": f"specq-cli-{uuid.uuid4().hex[:8]}"}
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    yield values
    get_settings.cache_clear()


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def ran(client: Client, pair: str, prompts: list[str]) -> int:
    """A job of ``prompts`` on ``pair``, run to the end in this process; its id."""
    settings = client.settings
    engine = load_pair(get_preset(pair, settings.presets_file), settings).engine()
    job = client.submit(prompts, pair=pair, enqueue=False, max_new_tokens=6)
    run_inline(sessions=client.sessions, engine=engine, pair=pair, job_id=job.id,
               progress=False)
    return job.id


def test_every_command_writes_each_figure_the_same_way(env, capsys):
    """A job that never drafted shows `-` for acceptance and speedup in status --watch,
    metrics and jobs; one that drafted shows the same digits in all three; a cancelled job
    is counted as cancelled, not done."""
    client = Client()
    plain = ran(client, "tiny-plain", ["Say one", "Say two"])
    drafted = ran(client, "tiny-fixed", ["Rewrite: a b c a b c", "Rewrite: x y x y"])
    cancelled = client.submit(["never run"] * 3, pair="tiny", enqueue=False)
    cancelled.cancel()

    _, table, _ = run(["jobs"], capsys)
    rows = {int(line.split()[0]): line for line in table.splitlines()[1:]}
    for job_id in (plain, drafted):
        m = client.job(job_id).metrics()
        _, watch, _ = run(["status", str(job_id), "--watch", "--interval", "0.01"], capsys)
        _, text, _ = run(["metrics", str(job_id)], capsys)
        rate = shown("acceptance_rate", m.acceptance_rate)
        assert f"acceptance {rate} " in watch
        assert re.search(rf"acceptance rate +{re.escape(rate)} ", text)
        assert f" {rate} " in rows[job_id]
        if job_id == plain:
            assert rate == "-" and "0.000" not in watch + text + rows[job_id]
        else:
            assert rate != "-"
    assert "estimated speedup       -" in run(["metrics", str(plain)], capsys)[1]
    # speedup: never drafted (then worker-seconds, cost, created, tenant)
    assert rows[plain].split()[-6] == "-"
    assert rows[drafted].split()[-6] == shown("estimated_speedup",
                                              client.job(drafted).metrics().estimated_speedup)
    # the cancelled job: 0 of 3 completed, 3 cancelled; never '3/3 done'
    assert rows[cancelled.id].split()[4:7] == ["0/3", "0", "3"]
    _, watch, _ = run(["status", str(cancelled.id), "--watch"], capsys)
    assert "0 completed, 0 failed, 3 cancelled, 0 pending of 3" in watch


def test_a_wait_bar_counts_only_what_finishes_while_it_watches(env, capsys):
    """Items finished before the wait began are where the bar starts, not a burst of
    progress: on a finished job no rate is shown at all."""
    client = Client()
    job = client.job(ran(client, "tiny-plain", ["one", "two", "three"]))
    capsys.readouterr()
    job.wait(progress=True)
    bar = capsys.readouterr().err
    assert "3/3" in bar and not re.search(r"[1-9][\d.,]*\s*item/s", bar), bar


def test_reconcile_says_what_it_did_in_words(env, capsys):
    code, out, _ = run(["reconcile"], capsys)
    assert code == 0 and out.startswith("checked 0 chunks that are not done, not leased")
    assert "nothing lost" in out
    code, out, _ = run(["reconcile", "--json"], capsys)
    assert json.loads(out)["resent"] == 0


def command(argv: list[str], environ: dict[str, str], **kw) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPECQ_")}
    return subprocess.run([sys.executable, "-m", "specq.api.cli", *argv],
                          env={**base, **environ}, capture_output=True, timeout=120, **kw)


def test_a_reader_that_goes_away_ends_the_output_quietly(env):
    """`specq jobs --json | head`: the pipe's reader is gone before anything is written."""
    read, write = os.pipe()
    os.close(read)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPECQ_")}
    out = subprocess.run([sys.executable, "-m", "specq.api.cli", "jobs", "--json"],
                         env={**base, **env}, stdout=write, stderr=subprocess.PIPE, timeout=120)
    os.close(write)
    assert out.stderr == b"" and out.returncode == 141


def test_submit_dash_reads_standard_input_and_warns_once(env, tmp_path):
    """`specq submit -` reads JSONL from stdin; a broker that cannot be reached is said once
    (the job is stored all the same)."""
    lines = b'{"prompt": "from stdin"}\n\n{"custom_id": "b", "prompt": "second"}\n'
    out = command(["submit", "-", "--pair", "tiny"], {**env, "SPECQ_BROKER_URL":
                  "redis://127.0.0.1:1/0", "SPECQ_BROKER_TIMEOUT": "1"}, input=lines)
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode().startswith("job ") and "2 items" in out.stdout.decode()
    assert out.stderr.decode().count("cannot be reached") == 1, out.stderr
    assert out.stderr.decode().startswith("warning: job ")
    client = Client()
    job_id = int(out.stdout.split()[1].rstrip(b":"))
    assert [(r.custom_id, r.prompt) for r in client.job(job_id).results()] == [
        ("request-0", "from stdin"), ("b", "second")]
    with client.sessions() as s:
        assert s.scalar(select(Job.source).where(Job.id == job_id)) == "<stdin>"
    bad = command(["submit", "-", "--pair", "tiny"], env, input=b'{"prompt": ""}\n')
    assert bad.returncode == 2 and b"line 1: prompt: must not be empty" in bad.stderr


def test_one_item_is_an_item_and_a_rounded_zero_has_no_sign(env, tmp_path, capsys):
    path = tmp_path / "one.jsonl"
    path.write_text('{"prompt": "just one"}\n')
    code, out, _ = run(["submit", str(path), "--pair", "tiny"], capsys)
    assert code == 0 and ": 1 item on pair tiny," in out, out
    assert shown("device_seconds_saved", -0.01) == "0.0 s"  # not -0.0 s
    assert shown("device_seconds_saved", -0.06) == "-0.1 s"


def test_help_names_the_commands_people_run(capsys):
    for name in cli.HEAVY:
        with pytest.raises(SystemExit) as exc:
            cli.main([name, "--help"])
        assert exc.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith(f"usage: specq {name}"), name
        assert not re.search(r"(?<![\w.])(worker|api)\.(bench|client|app|startup)", text), name


def test_database_errors_say_the_next_true_step():
    missing = f"specq_missing_{uuid.uuid4().hex[:8]}"
    out = command(["migrate"], {"SPECQ_DATABASE_URL":
                                f"postgresql+psycopg://postgres@127.0.0.1:5432/{missing}"})
    err = out.stderr.decode()
    assert out.returncode == 1 and f'database "{missing}" does not exist' in err
    assert f"create it first (`createdb {missing}`" in err
    out = command(["migrate"], {"SPECQ_DATABASE_URL":
                                "postgresql+psycopg://specq_no_such_user@127.0.0.1:5432/postgres"})
    err = out.stderr.decode()
    assert "no such user on the server" in err and "specq migrate" not in err
    assert "check the user and password" in cli.database_hint(
        'FATAL:  password authentication failed for user "specq"')
    assert "run `specq migrate`" in cli.database_hint('relation "jobs" does not exist')
    assert cli.database_hint("something else entirely") == ""


def test_migrate_hides_every_secret_of_the_url(pg_url):
    """`specq -v migrate` shows the database as `specq config` does: the password, and a
    query value named like a secret (libpq's ?password=), as ***, in its log and its line."""
    user, _, rest = pg_url.partition("@")
    url = f"{user}:S3cr3tPW@{rest}?password=QS3cr3t"
    out = command(["-v", "migrate"], {"SPECQ_DATABASE_URL": url})
    err = out.stderr.decode()
    assert out.returncode == 0 and "schema at head" in err, err
    assert "S3cr3t" not in err and "?password=***" in err


def test_postgres_urls_are_taken_as_postgresql_psycopg():
    s = Settings(database_url="postgres://u:pw@db.example:5432/specq")
    assert s.database_url == "postgresql+psycopg://u:pw@db.example:5432/specq"


def test_migrate_works_from_any_directory(tmp_path):
    """`specq migrate` finds its migrations wherever it runs (`alembic upgrade head` needs
    the project's alembic.ini: `alembic -c PATH/alembic.ini`)."""
    url = f"sqlite:///{tmp_path / 'm.db'}"
    out = command(["migrate"], {"SPECQ_DATABASE_URL": url}, cwd=tmp_path)
    assert out.returncode == 0 and b"schema at head" in out.stderr


def test_stdin_is_read_once_as_jsonl_lines(monkeypatch):
    from specq.api.inputs import open_source

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'"a"\n\xff\n')))
    name, entries = open_source("-")
    assert name == "<stdin>"
    assert [where for where, _ in entries] == ["line 1", "line 2"]
    assert "not valid UTF-8" in entries[1][1]
