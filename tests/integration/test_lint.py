"""House style, enforced: ruff on the Python, ansible-lint's production profile on the collection v100box.llm
(roles, playbooks, its metadata), and a syntax check of every playbook by its collection name, in one
ansible-playbook run (which names each file it checked, so it is the same check as by path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COLLECTION = ROOT / "ansible_collections/v100box/llm"
PLAYBOOKS = sorted(path.stem for path in (COLLECTION / "playbooks").glob("*.yml"))
BIN = Path(sys.executable).parent


def run(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]), "NO_COLOR": "1",
           "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False)


def test_ruff():
    done = run(str(BIN / "ruff"), "check", "controller", "ansible_collections", "benchmarks", "tests")
    assert done.returncode == 0, done.stdout[-4000:]


@pytest.mark.slow
def test_ansible_lint_production_profile():
    # Run in the collection's folder, ansible-lint knows it for one (galaxy.yml) and checks its metadata too;
    # .config/ansible-lint.yml holds the settings.
    done = run(str(BIN / "ansible-lint"), "--profile", "production", "--nocolor", "--format", "pep8", cwd=COLLECTION)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def test_playbooks_by_collection_name_from_anywhere(tmp_path):
    """`ansible-playbook v100box.llm.site` finds the clone's collection through ansible.cfg alone, from any folder, and
    every playbook passes the syntax check."""
    done = run(str(BIN / "ansible-playbook"), "--syntax-check", "-i", "localhost,",
               *(f"v100box.llm.{playbook}" for playbook in PLAYBOOKS), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    found = [line.split(": ", 1)[1] for line in done.stdout.splitlines() if line.startswith("playbook: ")]
    assert found == [str(COLLECTION / "playbooks" / f"{playbook}.yml") for playbook in PLAYBOOKS], done.stdout
