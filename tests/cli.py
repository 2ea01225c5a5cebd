"""Run the controller's CLI the way a user does: a new Python process from the repository root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_controller(*args: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m controller ARGS`` with its output captured; a non-zero exit is returned, never raised."""
    return subprocess.run([sys.executable, "-m", "controller", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=timeout, check=False)
