"""The suite keeps the descriptor limit it starts with: nothing imports ansible_test into the pytest process
(its package lowers the importing process's soft RLIMIT_NOFILE to 1024 on import, and the gateway's tests, which
hold 1100 connections, then failed in CI with EMFILE). ansible_test is asked in child processes only."""

from __future__ import annotations

import ast
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_no_test_or_lab_module_imports_ansible_test_in_process():
    offenders = [str(path.relative_to(ROOT)) for folder in ("tests", "lab", "benchmarks")
                 for path in sorted((ROOT / folder).rglob("*.py"))
                 if any(name == "ansible_test" or name.startswith("ansible_test.") for name in _imports(path))]
    assert offenders == []


def test_importing_ansible_test_would_lower_the_limit_so_the_check_above_matters():
    code = ("import resource; before = resource.getrlimit(resource.RLIMIT_NOFILE)[0]; "
            "import ansible_test._internal; print(before, resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    before, after = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                            check=True).stdout.split())
    assert before > 1024 and after == 1024, (before, after)


def test_the_suite_runs_with_room_for_the_gateway_tests():
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert soft == resource.RLIM_INFINITY or soft >= 1100 + 256, soft
