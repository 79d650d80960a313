"""`specq report` as a reader sees it: the Figure is inspected before it is saved (titles,
integer tick labels on integer axes, words where a panel has nothing to draw), and the PNG
is written."""

from __future__ import annotations

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from specq.api.client import JobMetrics
from specq.api.report import (
    NEVER_DRAFTED,
    NEVER_RAN,
    draw_report,
    format_metrics,
    report_figure,
)

DRAFTED = JobMetrics(
    job_id=12, status="completed", total=40, completed=38, failed=1, cancelled=1, pending=0,
    wall_time=8.0, draft_steps=60, proposed=180, accepted=110, accepted_by_position=[50, 35, 25],
    target_passes=160, new_tokens=400, steps_by_draft_length=[40, 10, 20, 60], draft_time=1.0,
    verify_time=6.0, draft_length_over_time=[2.5, 2.2, 1.8, 2.0, 2.4, 2.6, 1.0, 0.5, 2.0, 2.2],
    throughput_over_time=[(0.2 + 0.4 * i, 40.0 + 10 * (i % 3)) for i in range(20)],
    pair="smollm2-135m", drafter="prompt_lookup", draft_mode="adaptive", draft_length=3)
NEVER = JobMetrics(
    job_id=13, status="completed", total=4, completed=4, failed=0, cancelled=0, pending=0,
    wall_time=2.0, target_passes=40, new_tokens=36, steps_by_draft_length=[36],
    verify_time=1.5, draft_length_over_time=[0.0], throughput_over_time=[(1.0, 18.0)],
    pair="tiny", drafter="none")


def drawn(m: JobMetrics) -> dict:
    """The report's panels by title, after a draw (tick labels exist only then)."""
    fig = report_figure(m)
    FigureCanvasAgg(fig).draw()
    return {"figure": fig, **{ax.get_title(): ax for ax in fig.axes}}


def labels(axis) -> list[str]:
    return [t.get_text() for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]


def texts(ax) -> str:
    return " ".join(t.get_text() for t in ax.texts)


def is_integer(text: str) -> bool:
    return text.replace("\u2212", "-").lstrip("-").isdigit()


def test_titles_name_the_job_pair_and_drafter_and_integer_axes_have_integer_ticks(tmp_path):
    p = drawn(DRAFTED)
    title = p["figure"].get_suptitle()
    for needle in ("job 12", "pair smollm2-135m", "drafter prompt_lookup/adaptive:3",
                   "acceptance 0.611", "estimated speedup 2.14x", "1 cancelled"):
        assert needle in title
    assert set(p) == {"figure", "acceptance by draft position", "steps by draft length g",
                      "draft length over time", "throughput over time"}
    assert labels(p["acceptance by draft position"].xaxis) == ["1", "2", "3"]
    steps = p["steps by draft length g"]
    assert labels(steps.xaxis) == ["0", "1", "2", "3"]
    assert all(is_integer(t) for t in labels(steps.yaxis))
    assert labels(p["draft length over time"].xaxis) == [str(i) for i in range(1, 11)]
    over_time = p["throughput over time"]
    assert len(over_time.lines) == 1 and len(over_time.lines[0].get_xdata()) == 20
    assert "tokens/s" in over_time.get_ylabel()

    png = draw_report(DRAFTED, tmp_path / "r.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_a_job_that_never_drafted_says_so_instead_of_empty_panels(tmp_path):
    p = drawn(NEVER)
    title = p["figure"].get_suptitle()
    assert "acceptance -" in title and "estimated speedup -" in title
    for name in ("acceptance by draft position", "draft length over time"):
        ax = p[name]
        assert NEVER_DRAFTED in texts(ax), name
        assert not ax.patches and not ax.lines and labels(ax.xaxis) == [], name
    assert "never drafted" in texts(p["steps by draft length g"])
    assert labels(p["steps by draft length g"].xaxis) == ["0"]
    # a single value is a bar with a note, not a lonely dot
    one = p["throughput over time"]
    assert not one.lines and len(one.patches) == 1 and "one chunk" in texts(one)
    text = format_metrics(NEVER)
    assert "never drafted" in text and "estimated speedup       -" in text
    assert draw_report(NEVER, tmp_path / "n.png").stat().st_size > 10_000


def test_a_job_that_never_ran_says_nothing_ran_not_never_drafted(tmp_path):
    """A job cancelled before any worker took it: no step ran, so 'every step ran the
    target alone' would be false."""
    m = JobMetrics(job_id=14, status="cancelled", total=4, completed=0, failed=0,
                   cancelled=4, pending=0, wall_time=0.0, pair="tiny", drafter="prompt_lookup")
    p = drawn(m)
    assert NEVER_RAN in texts(p["draft length over time"])
    assert NEVER_DRAFTED not in texts(p["acceptance by draft position"])
    text = format_metrics(m)
    assert NEVER_RAN in text and "every step ran" not in text
    assert draw_report(m, tmp_path / "new" / "c.png").stat().st_size > 10_000  # folder made


def test_one_chunk_of_draft_lengths_is_a_bar_with_a_note():
    m = JobMetrics(**{**DRAFTED.__dict__, "draft_length_over_time": [1.5]})
    ax = drawn(m)["draft length over time"]
    assert not ax.lines and len(ax.patches) == 1 and "one chunk: mean g 1.50" in texts(ax)


def test_grammar_forced_drafts_are_drafts_of_their_own_kind():
    """A structured job whose drafts were all forced by its grammar, proposed at g = 0: the
    table does not pair 'mean draft length 0' with a mean acceptance length of 5 and leave
    the drafts unexplained; it counts draft tokens per draft step by kind."""
    m = JobMetrics(
        job_id=14, status="completed", total=2, completed=2, failed=0, cancelled=0, pending=0,
        wall_time=1.0, draft_steps=10, proposed=40, accepted=40, forced_proposed=40,
        forced_accepted=40, accepted_by_position=[10, 10, 10, 10], target_passes=30,
        new_tokens=60, steps_by_draft_length=[30], verify_time=0.9, pair="tiny",
        drafter="prompt_lookup", steps_by_drafts_verified=[20, 0, 0, 0, 10])
    text = format_metrics(m)
    assert "mean acceptance length  5.00" in text
    # per row and step, every kind: 10 of its 30 row-steps verified 4 drafts
    assert "drafts verified per row 1.33  (0:67%  4:33%)" in text
    assert "verified per token      1.17" in text  # (30 passes + 40 drafts) / 60 tokens
    assert "draft tokens per step   4.00  (0 from the drafter, 40 forced by a grammar" in text
    assert "grammar drafts          1.00" in text and "never drafted" not in text
    assert "draft tokens per step   -" in format_metrics(NEVER)


def test_a_single_chunk_job_has_a_course_over_time(db_client, tmp_path):
    """A job of one chunk is drawn at the grain of its items: draft length and throughput
    over time have several points, not one bar with a note."""
    from specq.configs.presets import get_preset
    from specq.configs.settings import Settings
    from specq.worker.pairs import load_pair
    from specq.worker.tasks import run_inline

    engine = load_pair(get_preset("tiny-fixed"),
                       Settings(data_dir=db_client.settings.data_dir)).engine(max_batch_size=2)
    lines = [{"prompt": f"Count to {i}:", "max_new_tokens": 3 + 3 * i} for i in range(6)]
    job = db_client.submit(lines, pair="tiny-fixed", enqueue=False, chunk_size=100)
    run_inline(sessions=db_client.sessions, engine=engine, pair="tiny-fixed", job_id=job.id,
               progress=False)
    m = job.metrics()
    assert m.completed == 6
    assert len(m.draft_length_over_time) == 6 and len(m.throughput_over_time) > 1
    p = drawn(m)
    for title in ("draft length over time", "throughput over time"):
        assert "one chunk" not in texts(p[title]) and p[title].lines, title


PNG = b"\x89PNG\r\n\x1a\n"


def test_a_name_without_a_suffix_is_written_as_png_and_the_path_says_so(tmp_path):
    """`specq report JOB -o report` prints the path draw_report returns: the file made."""
    path = draw_report(NEVER, tmp_path / "report")
    assert path == tmp_path / "report.png" and sorted(tmp_path.iterdir()) == [path]
    assert path.read_bytes()[:8] == PNG
    svg = draw_report(NEVER, tmp_path / "report.SVG")
    assert svg == tmp_path / "report.SVG" and b"<svg" in svg.read_bytes()[:1000]


def test_a_report_to_a_pipe_keeps_its_name_and_is_a_png():
    """`specq report JOB -o >(cat > r.png)`: /dev/fd/N is written as it is, no .png added."""
    import os
    import threading

    read, write = os.pipe()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(os.fdopen(read, "rb").read()),
                              daemon=True)
    reader.start()
    try:
        path = draw_report(NEVER, f"/dev/fd/{write}")
    finally:
        os.close(write)
    reader.join(30)  # a bound on a hang: the report's end is written already
    assert str(path) == f"/dev/fd/{write}" and got and got[0][:8] == PNG


def test_the_output_checked_is_the_file_drawn(tmp_path):
    """`specq report JOB -o NAME` draws NAME.png: that path is checked before any work too
    (a directory NAME.png refused at once, naming it), beside NAME itself."""
    from specq.api.cli import _image
    from specq.api.outputs import OutputError

    (tmp_path / "taken.png").mkdir()
    with pytest.raises(OutputError, match="taken.png: is a directory"):
        _image(str(tmp_path / "taken"))
    (tmp_path / "dir").mkdir()
    with pytest.raises(OutputError, match="dir: is a directory"):
        _image(str(tmp_path / "dir"))
    assert _image(str(tmp_path / "new")) == str(tmp_path / "new")
