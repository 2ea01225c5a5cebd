"""House style, enforced: ruff on the Python, ansible-lint's production profile on roles and
playbooks, and a syntax check of every playbook."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]), "NO_COLOR": "1",
           "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)


def test_ruff():
    done = run(str(BIN / "ruff"), "check", "controller", "plugins", "benchmarks", "tests")
    assert done.returncode == 0, done.stdout[-4000:]


@pytest.mark.slow
def test_ansible_lint_production_profile():
    done = run(str(BIN / "ansible-lint"), "--profile", "production", "--nocolor", "--format", "pep8", "roles", "playbooks")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


@pytest.mark.parametrize("playbook", sorted(path.name for path in (ROOT / "ansible_collections/v100box/llm/playbooks").glob("*.yml")))
def test_playbook_syntax(playbook):
    done = run(str(BIN / "ansible-playbook"), "--syntax-check", "-i", "localhost,", f"ansible_collections/v100box/llm/playbooks/{playbook}")
    assert done.returncode == 0, done.stdout + done.stderr
