"""Writing the artefacts people read: never half a file."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def write_atomic(path: Path, data: str | bytes, *, private: bool = False) -> None:
    """Replace ``path`` atomically (a temporary file beside it, then a rename), creating its folder.

    ``private``: the file stays owner-only (0600) from its first byte, for files that hold secrets."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
        if not private:
            os.chmod(tmp, 0o666 & ~_umask())  # the mode an ordinary write would give, not mkstemp's 0600
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


_held: dict[Path, int] = {}  # inventory folders this process has locked, with their nesting depth


@contextlib.contextmanager
def inventory_lock(folder: Path, what: str, notice: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold ``<folder>/.lock`` (fcntl.flock) for the length of a render or run.

    A second controller on the same inventory waits here, saying once who holds it, instead of
    interleaving its renders and runs with the first; Ctrl-C gives up waiting. Re-entrant within one
    process (provision renders, then runs, under the one lock).
    """
    folder = folder.resolve()
    if folder in _held:
        _held[folder] += 1
        try:
            yield
        finally:
            _held[folder] -= 1
        return
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = path.read_text().strip() or "another controller"
            (notice or to_stderr)(f"inventory {folder} is in use by {holder}; waiting for it to finish "
                                   "(Ctrl-C to give up)")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} ({what})\n".encode(), 0)
        _held[folder] = 1
        try:
            yield
        finally:
            del _held[folder]
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def to_stderr(message: str) -> None:
    """The default way a library call tells the operator something (a wait, a newly recorded host key)."""
    print(message, file=sys.stderr, flush=True)
