"""Output paths as a shell user names them: a FIFO, a device, a symbolic link, `>(...)`
(/dev/fd/N of a pipe), a file kept private. A stream is written where it is and stays what
it was; a link is followed; a file written over keeps its mode (and its owner, as root)."""

from __future__ import annotations

import io
import json
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specq.api.formats import JsonlSink, ParquetSink, write_batches
from specq.api.outputs import OutputError, check_output

ROWS = [{"n": 1, "text": "one"}, {"n": 2, "text": "two"}]
JSONL = "".join(json.dumps(r) + "\n" for r in ROWS).encode()


class Reader(threading.Thread):
    """Reads everything ``open_`` gives until its writer closes it, as `cat` would."""

    def __init__(self, open_: Callable[[], io.BufferedReader]) -> None:
        super().__init__(daemon=True)  # a writer that never opens must not hang the suite
        self.open_, self.data = open_, b""

    def run(self) -> None:
        with self.open_() as f:
            self.data = f.read()

    def result(self) -> bytes:
        self.join(30)  # a bound on a hang, not a timing: the writer has closed already
        assert not self.is_alive(), "the reader never saw the end of the output"
        return self.data


def fifo_reader(path: Path) -> Reader:
    os.mkfifo(path)
    reader = Reader(lambda: open(path, "rb"))
    reader.start()
    return reader


def test_a_fifo_is_written_where_it_is_and_stays_a_fifo(tmp_path):
    path = tmp_path / "fifo"
    reader = fifo_reader(path)
    assert write_batches(JsonlSink(path), ROWS, batch=1) == 2
    assert stat.S_ISFIFO(os.lstat(path).st_mode) and sorted(tmp_path.iterdir()) == [path]
    assert reader.result() == JSONL


def test_parquet_streams_to_a_fifo(tmp_path):
    path = tmp_path / "fifo.parquet"
    reader = fifo_reader(path)
    assert write_batches(ParquetSink(path), ROWS, batch=1) == 2
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    assert pq.read_table(io.BytesIO(reader.result())).to_pylist() == ROWS


def test_a_process_substitution_path_is_written_as_a_pipe(tmp_path):
    """`-o >(wc -c)`: the shell passes /dev/fd/N, a pipe; nothing can be made beside it."""
    for sink, decode in ((JsonlSink, bytes), (ParquetSink,
                                                lambda b: pq.read_table(io.BytesIO(b)))):
        read, write = os.pipe()
        reader = Reader(lambda read=read: os.fdopen(read, "rb"))
        reader.start()
        try:
            path = f"/dev/fd/{write}"
            assert check_output(path, "parquet") == path
            assert write_batches(sink(path), ROWS) == 2
        finally:
            os.close(write)  # the shell's end: the reader sees EOF once both are closed
        got = decode(reader.result())
        assert (got if sink is JsonlSink else got.to_pylist()) == (
            JSONL if sink is JsonlSink else ROWS)


def test_a_failed_write_to_a_fifo_leaves_it_a_fifo(tmp_path):
    path = tmp_path / "fifo"
    reader = fifo_reader(path)

    def rows():
        yield ROWS[0]
        raise RuntimeError("the database went away")

    with pytest.raises(RuntimeError, match="went away"):
        write_batches(JsonlSink(path), rows(), batch=1)
    assert stat.S_ISFIFO(os.lstat(path).st_mode) and sorted(tmp_path.iterdir()) == [path]
    assert reader.result() == JSONL.splitlines(keepends=True)[0]


def test_a_file_that_cannot_be_put_in_place_leaves_no_part_file(tmp_path):
    path = tmp_path / "out.jsonl"
    sink = JsonlSink(path)
    path.mkdir()  # after the check and the open: the rename at close fails
    with pytest.raises(OutputError, match=f"output: {path}: Is a directory"):
        write_batches(sink, ROWS)  # (the path asked for, not the hidden part file)
    assert sorted(tmp_path.iterdir()) == [path]


def test_a_place_no_file_can_be_made_in_is_refused_before_any_work():
    """access() passes root everywhere; /proc takes no new file all the same: found by
    making one there, before a job runs for an output it cannot write."""
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    with pytest.raises(OutputError, match="no file can be made in /proc"):
        check_output("/proc/out.jsonl")


@pytest.mark.parametrize("sink", [JsonlSink, ParquetSink])
def test_a_write_that_fails_names_the_output(tmp_path, sink):
    """A full disk (a copy of /dev/full) is said of the path asked for, not as a bare
    "No space left on device"."""
    path = device_node(tmp_path / "full", 7)
    with pytest.raises(OutputError, match=f"output: {path}: No space left on device"):
        write_batches(sink(path), ROWS * 5000)


def test_a_failed_parquet_export_to_a_fifo_is_no_parquet_file(tmp_path):
    """Its reader must not get a whole file of fewer rows: no footer is written."""
    path = tmp_path / "fifo.parquet"
    reader = fifo_reader(path)

    def rows():
        yield ROWS[0]
        raise RuntimeError("the database went away")

    with pytest.raises(RuntimeError, match="went away"):
        write_batches(ParquetSink(path), rows(), batch=1)
    got = reader.result()
    assert got.startswith(b"PAR1")
    with pytest.raises(pa.ArrowInvalid):
        pq.read_table(io.BytesIO(got))


def device_node(path: Path, minor: int) -> Path:
    """A copy of the memory device 1:``minor`` (3 /dev/null, 7 /dev/full) at ``path``;
    the test is skipped where no device node can be made or opened there."""
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
    try:
        os.close(os.open(path, os.O_WRONLY))
    except PermissionError:
        pytest.skip("tmp_path is on a file system mounted nodev")
    return path


@pytest.fixture
def device(tmp_path) -> Path:
    """A copy of /dev/null under tmp_path: root only."""
    return device_node(tmp_path / "null", 3)


def test_a_character_device_is_written_not_replaced(device):
    assert write_batches(JsonlSink(device), ROWS) == 2
    assert write_batches(ParquetSink(device), ROWS) == 2
    assert stat.S_ISCHR(os.lstat(device).st_mode) and os.lstat(device).st_rdev == \
        os.makedev(1, 3)
    assert sorted(device.parent.iterdir()) == [device]


def test_a_symlink_is_followed_and_its_target_replaced_in_its_own_directory(tmp_path):
    (tmp_path / "here").mkdir()
    (tmp_path / "there").mkdir()
    target, link = tmp_path / "there" / "out.jsonl", tmp_path / "here" / "out.jsonl"
    target.write_text("old\n")
    link.symlink_to(target)
    assert write_batches(JsonlSink(link), ROWS) == 2
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_bytes() == JSONL
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["here", "out.jsonl", "out.jsonl",
                                                           "there"]  # no part file left


def test_a_dangling_symlink_makes_its_target(tmp_path):
    target, link = tmp_path / "new" / "out.parquet", tmp_path / "out.parquet"
    link.symlink_to(target)
    assert check_output(link, "parquet") == str(link)
    assert write_batches(ParquetSink(link), ROWS) == 2
    assert link.is_symlink() and pq.read_table(target).to_pylist() == ROWS


@pytest.mark.parametrize("sink, name", [(JsonlSink, "private.jsonl"),
                                        (ParquetSink, "private.parquet")])
def test_a_file_written_over_keeps_its_mode(tmp_path, sink, name):
    path = tmp_path / name
    path.write_text("secret")
    path.chmod(0o600)
    assert write_batches(sink(path), ROWS) == 2
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes() != b"secret"


def test_a_new_file_gets_the_mode_open_gives(tmp_path):
    """The umask decides, as for any file a command makes."""
    mask = os.umask(0o027)
    try:
        write_batches(JsonlSink(tmp_path / "new.jsonl"), ROWS)
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "new.jsonl").stat().st_mode) == 0o640


def test_a_file_written_over_keeps_its_owner_as_root(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a file away needs root")
    path = tmp_path / "theirs.jsonl"
    path.write_text("x")
    os.chown(path, 4321, 4322)
    path.chmod(0o640)
    write_batches(JsonlSink(path), ROWS)
    st = path.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (4321, 4322, 0o640)
    assert path.read_bytes() == JSONL


def test_a_socket_is_refused_before_any_work(tmp_path):
    import socket

    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        with pytest.raises(OutputError, match="a socket"):
            check_output(path)


def test_a_descriptor_of_a_regular_file_is_written_from_where_it_stands(tmp_path):
    """`{ echo header >&3; specq results J -o /dev/fd/3; echo footer >&3; } 3> all.txt`
    and `3>> log`: the output goes through the descriptor, after what the shell wrote, and
    the file stays the one the shell opened (by its name /dev/fd/3 is the file itself, and
    renamed over or truncated it lost the header)."""
    path = tmp_path / "all.txt"
    path.write_bytes(b"header\n")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        inode = os.fstat(fd).st_ino
        for name in (f"/dev/fd/{fd}", f"/proc/self/fd/{fd}", f"/proc/{os.getpid()}/fd/{fd}"):
            assert check_output(name) == name
            assert write_batches(JsonlSink(name), ROWS, batch=1) == 2
        os.write(fd, b"footer\n")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"header\n" + JSONL * 3 + b"footer\n"
    assert os.stat(path).st_ino == inode and sorted(tmp_path.iterdir()) == [path]


def test_a_closed_descriptor_and_a_directory_name_are_refused(tmp_path):
    read, write = os.pipe()
    os.close(read)
    os.close(write)
    with pytest.raises(OutputError, match=f"descriptor {write} is not open"):
        check_output(f"/dev/fd/{write}")
    with pytest.raises(OutputError, match="names a directory"):
        check_output(f"{tmp_path}/new/")
    assert sorted(tmp_path.iterdir()) == []


def test_sigterm_mid_export_leaves_the_old_file_and_no_part_file(tmp_path):
    """`kill` or `timeout` during an export: as Ctrl-C, the part file is taken back and the
    file that was there stays; the command ends with 143 (cli._term_is_exit)."""
    import signal

    from specq.api.cli import _term_is_exit

    path = tmp_path / "out.jsonl"
    path.write_text("old\n")

    def rows():
        yield ROWS[0]
        os.kill(os.getpid(), signal.SIGTERM)  # delivered here, in this thread, at once
        yield ROWS[1]

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as ended, _term_is_exit():
        write_batches(JsonlSink(path), rows(), batch=1)
    assert ended.value.code == 143
    assert path.read_text() == "old\n" and sorted(tmp_path.iterdir()) == [path]
    assert signal.getsignal(signal.SIGTERM) is before


def test_run_refuses_to_write_its_results_over_its_input(tmp_path, monkeypatch):
    """`specq run in.jsonl -o in.jsonl` (or through a link to it) would replace the prompts
    with the results: refused before anything is stored."""
    from specq.api.cli import main

    monkeypatch.setenv("SPECQ_DATA_DIR", str(tmp_path / "data"))
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    (tmp_path / "link").symlink_to(prompts)
    for out in (prompts, tmp_path / "link"):
        assert main(["run", str(prompts), "--pair", "tiny", "-o", str(out)]) == 2
        assert prompts.read_text() == '{"prompt": "hello"}\n'
    assert not (tmp_path / "data").exists()
