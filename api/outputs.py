"""Where a command's output file goes: every export, data set and report is written here.

A reader never sees half a file, and writing a file changes nothing but its contents.

- A regular file, or a path with nothing there yet, is written to a hidden part file beside
  it and renamed over it when complete. A failed write leaves no file, and an earlier file
  of that name stays as it was. A file that was there keeps its mode, and its owner and
  group where this process may set them.
- A symbolic link is followed: its target is written that way, in the target's directory,
  and the link stays a link.
- A path that is there and is neither a regular file nor a directory is written where it
  is, as a stream: a FIFO, a device such as /dev/null, a shell's `>(...)` (/dev/fd/N).
  Renaming over one would replace it with a regular file that no reader is waiting on.
- A descriptor of this process, named as /dev/stdout, /dev/stderr, /dev/fd/N or
  /proc/self/fd/N, is written through that descriptor, from where it stands: `3>> log`
  appends, and what the shell wrote before and after stays. (Opened by its name, a
  descriptor of a regular file would be the file itself, truncated or renamed over.)
- "-" is standard output.
- A path that ends in "/" names a directory: refused.
- A file is never its own input (``same_file``): `specq run` refuses to write its results
  over the prompts it reads.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import IO, Any


class OutputError(ValueError):
    """An output path that cannot be written; the message names it and why."""


def check_output(path: str | os.PathLike, fmt: str = "jsonl") -> str:
    """``path`` ("-" is stdout, which Parquet cannot use) if OutputFile can write there.
    A stream (is_stream) must be writable, and not a socket, which cannot be opened. Any
    other path is followed through its links; it must not be a directory, and its nearest
    existing parent must be a writable directory (the part file is made there; missing
    directories are created when the file is written). OutputError says why not."""
    text = str(path)
    if text == "":
        raise OutputError("output: must not be empty")
    if text == "-":
        if fmt == "parquet":
            raise OutputError("output: Parquet needs a file, not stdout")
        return text
    if "\x00" in text:
        raise OutputError("output: contains a NUL character")
    fd = descriptor(text)
    if fd is not None:
        try:
            os.fstat(fd)
        except OSError:
            raise OutputError(f"output: {text}: descriptor {fd} is not open") from None
        if fmt == "parquet" and os.isatty(fd):
            raise OutputError(f"output: {text}: Parquet needs a file, not a terminal")
        return text
    if text.endswith(("/", os.sep)):
        raise OutputError(f"output: {text}: names a directory")
    try:
        if is_stream(text):
            if stat.S_ISSOCK(os.stat(text).st_mode):
                raise OutputError(f"output: {text}: a socket, which cannot be opened as a file")
            if not os.access(text, os.W_OK):
                raise OutputError(f"output: {text}: not writable")
            return text
        target = Path(os.path.realpath(text))
        if target.is_dir():
            raise OutputError(f"output: {text}: is a directory")
        if target.exists() and not os.access(target, os.W_OK):
            raise OutputError(f"output: {text}: not writable")
        parent = target.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise OutputError(f"output: {text}: {parent} is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise OutputError(f"output: {text}: directory {parent} is not writable")
        _try_a_file_in(parent, text)
    except OSError as exc:  # a name too long, a loop of links, no file can be made there
        raise OutputError(f"output: {text}: {exc.strerror or exc}") from None
    return text


_DESCRIPTOR = re.compile(r"/dev/fd/(\d+)|/proc/(?:self|(\d+))/fd/(\d+)")
_STANDARD = {"/dev/stdout": 1, "/dev/stderr": 2}


def _try_a_file_in(directory: Path, text: str) -> None:
    """A file made and removed in ``directory``: what access() cannot tell (root passes it
    everywhere; /proc, a read-only mount), found before a job is run for nothing."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".specq-check-", dir=directory)
    except OSError as exc:
        raise OutputError(f"output: {text}: no file can be made in {directory} "
                          f"({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)


def descriptor(path: str | os.PathLike) -> int | None:
    """The open descriptor of this process that ``path`` names (/dev/stdout, /dev/stderr,
    /dev/fd/N, /proc/self/fd/N, /proc/PID/fd/N of this process), or None."""
    text = os.path.normpath(str(path))
    if text in _STANDARD:
        return _STANDARD[text]
    found = _DESCRIPTOR.fullmatch(text)
    if found is None or (found.group(2) and int(found.group(2)) != os.getpid()):
        return None
    return int(found.group(1) or found.group(3))


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths are one file (links followed; False where either is not there)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def is_stream(path: str | os.PathLike) -> bool:
    """Whether ``path`` (its links followed) is there and is neither a regular file nor a
    directory: a FIFO, a device, a socket, the pipe behind /dev/fd/N. Such a path is written
    where it is, never replaced."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def part_path(path: str | os.PathLike) -> Path:
    """Where a file is written before it is renamed to ``path``: beside it (the same file
    system, so the rename is atomic), hidden, named for this process."""
    target = Path(path)
    return target.with_name(f".{target.name}.{os.getpid()}.part")


class OutputFile:
    """An output being written to ``path`` as the module says: ``stream`` takes the text
    (or bytes, with ``binary``), close() puts it in place, abort() takes back what it can.
    As a context manager it closes on success and aborts on an error."""

    def __init__(self, path: str | os.PathLike, *, binary: bool = False) -> None:
        self.path = str(path)
        self._target: Path | None = None  # the file renamed over; None: written in place
        self._part: Path | None = None
        self.stream: IO[Any]
        fd = descriptor(self.path)
        if self.path == "-":
            sys.stdout.flush()
            self.stream = sys.stdout.buffer if binary else sys.stdout
        elif fd is not None:  # its own copy of the descriptor, closed alone
            sys.stdout.flush()
            sys.stderr.flush()
            self.stream = os.fdopen(os.dup(fd), "wb" if binary else "w",
                                    encoding=None if binary else "utf-8")
        elif is_stream(self.path):
            self.stream = open(self.path, "wb" if binary else "w",  # noqa: SIM115
                               encoding=None if binary else "utf-8")
        else:
            self._target = Path(os.path.realpath(self.path))
            self._part = part_path(self._target)
            try:
                self._target.parent.mkdir(parents=True, exist_ok=True)
                fd = _create_part(self._part, self._target)
            except OSError as exc:
                raise self.error(exc) from None
            self.stream = os.fdopen(fd, "wb" if binary else "w",
                                    encoding=None if binary else "utf-8")

    def error(self, exc: OSError) -> OutputError:
        """``exc`` said of the path asked for (not of the hidden part file, nor of nothing,
        as a write's error is)."""
        return OutputError(f"output: {self.path}: {exc.strerror or exc}")

    def close(self) -> None:
        """Finish the output: a part file is renamed over its target. One that cannot be
        (its last bytes not written: a full disk) is removed."""
        if self.path == "-":
            self.stream.flush()
            return
        try:
            self.stream.close()
            if self._part is not None and self._target is not None:
                os.replace(self._part, self._target)
        except BaseException:
            if self._part is not None:
                self._part.unlink(missing_ok=True)
            raise

    def abort(self) -> None:
        """Stop writing and remove the part file. A stream keeps what it was sent (its
        reader has read it), and an error closing it does not hide the one being raised."""
        if self.path == "-":
            with contextlib.suppress(OSError):
                self.stream.flush()
            return
        try:
            with contextlib.suppress(OSError):
                self.stream.close()
        finally:
            if self._part is not None:
                self._part.unlink(missing_ok=True)

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            with said_of(self):  # the last bytes, or the rename
                self.close()
        else:
            self.abort()
            if isinstance(error, OSError) and _failed_write(error):
                raise self.error(error) from error


def _failed_write(error: BaseException | None) -> bool:
    """Whether ``error`` is a write's own failure (a full disk, a device's end), said
    without the path; a reader gone (a broken pipe) is not: the CLI ends quietly there."""
    return isinstance(error, OSError) and not isinstance(error, (BrokenPipeError, OutputError))


@contextlib.contextmanager
def said_of(out: OutputFile) -> Any:
    """Within it, a write's failure is an OutputError naming ``out``'s path."""
    try:
        yield
    except OSError as exc:
        if not _failed_write(exc):
            raise
        raise out.error(exc) from exc


def _create_part(part: Path, target: Path) -> int:
    """Open ``part`` as a new file, for writing. One left by an earlier process of this id
    is removed first, so a link planted there is never followed. Beside a file that is
    there already, the part takes that file's owner and mode before a byte is written; a
    new file gets the mode the umask leaves, as open() gives."""
    part.unlink(missing_ok=True)
    try:
        was: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        was = None
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if was else 0o666)
    try:
        if was is not None:
            _keep_owner_and_mode(fd, was)
    except BaseException:
        os.close(fd)
        part.unlink(missing_ok=True)
        raise
    return fd


def _keep_owner_and_mode(fd: int, was: os.stat_result) -> None:
    """Give the open file ``fd`` the owner, group and mode of ``was``. The owner is set only
    where this process may (root may); the group alone is tried next (a group the user is
    in). The mode is set last: changing the owner clears set-user-id bits."""
    now = os.fstat(fd)
    if (now.st_uid, now.st_gid) != (was.st_uid, was.st_gid):
        try:
            os.fchown(fd, was.st_uid, was.st_gid)
        except PermissionError:
            with contextlib.suppress(PermissionError):
                os.fchown(fd, -1, was.st_gid)
    os.fchmod(fd, stat.S_IMODE(was.st_mode))
