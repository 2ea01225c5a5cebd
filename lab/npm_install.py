"""Install a pinned npm package once into a cache folder, for the real clients the tests run (lab/claude_code.py,
lab/openclaw.py): idempotent, safe when two sessions install at once, and checked by the version it prints."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path


def executable(folder: Path, name: str) -> Path:
    return folder / "node_modules" / ".bin" / name


def install_once(folder: Path, name: str, npm: list[str], spec: str, check: Callable[[Path], None],
                 env: dict[str, str] | None = None) -> Path:
    """``folder``'s ``name`` binary, installed with ``npm install ... spec`` into a staging folder beside it first;
    ``check`` gets the staging folder and raises when what was installed is not what was pinned."""
    if executable(folder, name).exists():
        return executable(folder, name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if executable(folder, name).exists():
            return executable(folder, name)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        try:
            # The caller's own npm settings (a registry mirror in ~/.npmrc, say) apply.
            subprocess.run([*npm, "install", "--no-save", "--no-audit", "--no-fund", "--loglevel=error",
                            "--prefix", str(staging), spec], check=True, stdout=subprocess.DEVNULL, env=env)
            check(staging)
            os.replace(staging, folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return executable(folder, name)
