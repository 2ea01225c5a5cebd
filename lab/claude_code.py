"""The pinned Claude Code client, installed with npm into the build cache.

Tests run the real ``claude`` program against the box's llama-server. The npm package ships a
native executable, so the machine's Node only runs npm itself. One install per version lives under
``~/.cache/v100-llm-box/claude-code/<version>``; a file lock makes concurrent callers wait for
the first one instead of installing twice. Run as ``python -m lab.claude_code`` to warm the cache.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from lab.engine_build import cache_root
from lab.npm_install import executable, install_once

CLAUDE_CODE_PACKAGE = "@anthropic-ai/claude-code"
CLAUDE_CODE_VERSION = "2.1.330"

# Variables of the caller's environment that would point the client elsewhere or change its
# behaviour; claude_env drops them so only what the test passes is in effect.
_DROPPED_PREFIXES = ("ANTHROPIC_", "CLAUDE_", "CLAUDECODE", "OTEL_", "AWS_", "GOOGLE_", "VERTEX_")


def install_dir(version: str = CLAUDE_CODE_VERSION) -> Path:
    return cache_root() / "claude-code" / version


def claude_binary(version: str = CLAUDE_CODE_VERSION) -> Path:
    """Install the pinned Claude Code once (idempotent, concurrent-safe) and return ``claude``."""
    def check(staging: Path) -> None:
        probe = subprocess.run([str(executable(staging, "claude")), "--version"], check=True,
                               capture_output=True, text=True, env=claude_env({}, home=staging))
        if not probe.stdout.startswith(version):
            raise RuntimeError(f"claude --version printed {probe.stdout!r}, expected {version}")

    return install_once(install_dir(version), "claude", ["npm"], f"{CLAUDE_CODE_PACKAGE}@{version}", check)


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
