"""Writing the artefacts people read: never half a file (the inventory folder's layout is controller/inventory.py)."""

from __future__ import annotations

import os
import sys
import tempfile
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


def to_stderr(message: str) -> None:
    """The default way a library call tells the operator something (a wait, a newly recorded host key)."""
    print(message, file=sys.stderr, flush=True)
