"""The pinned Claude Code client, installed with npm into the build cache.

Tests run the real ``claude`` program against the box's llama-server. The npm package ships a
native executable, so the machine's Node only runs npm itself. One install per version lives under
``~/.cache/v100-llm-box/claude-code/<version>``; a file lock makes concurrent callers wait for
the first one instead of installing twice. Run as ``python -m lab.claude_code`` to warm the cache.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from lab.engine_build import cache_root

CLAUDE_CODE_PACKAGE = "@anthropic-ai/claude-code"
CLAUDE_CODE_VERSION = "2.1.330"

# Variables of the caller's environment that would point the client elsewhere or change its
# behaviour; claude_env drops them so only what the test passes is in effect.
_DROPPED_PREFIXES = ("ANTHROPIC_", "CLAUDE_", "CLAUDECODE", "OTEL_", "AWS_", "GOOGLE_", "VERTEX_")


def install_dir(version: str = CLAUDE_CODE_VERSION) -> Path:
    return cache_root() / "claude-code" / version


def _executable(folder: Path) -> Path:
    return folder / "node_modules" / ".bin" / "claude"


def claude_binary(version: str = CLAUDE_CODE_VERSION) -> Path:
    """Install the pinned Claude Code once (idempotent, concurrent-safe) and return ``claude``."""
    folder = install_dir(version)
    if _executable(folder).exists():
        return _executable(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _executable(folder).exists():
            return _executable(folder)
        staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=folder.parent))
        try:
            subprocess.run(
                ["npm", "install", "--no-save", "--no-audit", "--no-fund", "--loglevel=error",
                 "--prefix", str(staging), f"{CLAUDE_CODE_PACKAGE}@{version}"],
                check=True, stdout=subprocess.DEVNULL,
            )
            probe = subprocess.run([str(_executable(staging)), "--version"], check=True,
                                   capture_output=True, text=True, env=claude_env({}, home=staging))
            if not probe.stdout.startswith(version):
                raise RuntimeError(f"claude --version printed {probe.stdout!r}, expected {version}")
            os.replace(staging, folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return _executable(folder)


def claude_env(base: dict, home: Path | None = None) -> dict:
    """An environment for ``claude``: the caller's PATH/locale, a private HOME, then ``base``.

    ``home`` defaults to a fresh temporary folder (the caller removes it); the client writes its
    state there, never into the real home. Auto-update and telemetry stay off.
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith(_DROPPED_PREFIXES)}
    if home is None:
        home = Path(tempfile.mkdtemp(prefix="claude-home-"))
    Path(home).mkdir(mode=0o700, parents=True, exist_ok=True)
    env["HOME"] = str(home)
    env.pop("XDG_CONFIG_HOME", None)
    env.update({
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    })
    env.update({key: str(value) for key, value in base.items()})
    return env


if __name__ == "__main__":
    print(claude_binary())
