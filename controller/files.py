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
    process (provision renders, then runs, under the one lock). A controller that was killed leaves the
    lock free, but its run may not be over yet: this waits for that too (``run_lock_path``).
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
        _wait_for_runs(folder, os.pread(fd, 4096, 0).decode(errors="replace").strip(), notice or to_stderr)
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


def run_lock_path(folder: Path) -> Path:
    """The lock every process of a run of this inventory holds shared (controller.stages.runner hands it to the run),
    so the run counts as alive until its last process (ansible-playbook and each of its workers) ended."""
    return folder / ".run.lock"


def _wait_for_runs(folder: Path, last_holder: str, notice: Callable[[str], None]) -> None:
    """Return once no process of a run of ``folder`` lives on (normally at once: a run ends with its controller)."""
    fd = os.open(run_lock_path(folder), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            notice(f"inventory {folder}: the run of {last_holder or 'a controller'}, which ended, is still "
                   "stopping; waiting for its last task to end (Ctrl-C to give up)")
            fcntl.flock(fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)  # released at once: this controller's own run takes it shared


def to_stderr(message: str) -> None:
    """The default way a library call tells the operator something (a wait, a newly recorded host key)."""
    print(message, file=sys.stderr, flush=True)
