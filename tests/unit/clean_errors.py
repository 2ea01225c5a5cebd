"""What an operator must see when an input is wrong: one line on stderr, the documented exit code, no traceback."""

from __future__ import annotations

import subprocess


def assert_one_line_error(result: subprocess.CompletedProcess[str], exit_code: int, *words: str) -> str:
    """The error line of a finished ``run_controller``; it must name every one of ``words``."""
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert result.returncode == exit_code, output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, output
    for word in words:
        assert word in lines[0], output
    return lines[0]
