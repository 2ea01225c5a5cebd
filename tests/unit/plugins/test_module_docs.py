"""Every module of the collection documents itself so that ``ansible-doc`` reads it: DOCUMENTATION, EXAMPLES and
RETURN parse, every description is text (a ``key: value`` inside a description item turns it into a mapping), and
the examples call the module by its full name. A Windows module is documented by the .py of its name
(win_llama_api_check.py; its options are llama_api_check's, a documentation fragment of the collection)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
MODULES = ROOT / "ansible_collections/v100box/llm/plugins/modules"
NAMES = sorted({path.stem for path in MODULES.iterdir() if path.suffix in (".py", ".ps1")})
ANSIBLE_DOC = str(Path(sys.executable).parent / "ansible-doc")


@cache
def ansible_doc(*args: str) -> subprocess.CompletedProcess[str]:
    """ansible-doc for modules of the collection, found where it lies in the checkout."""
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(ROOT), "ANSIBLE_NOCOLOR": "1"}
    env.pop("ANSIBLE_CONFIG", None)  # no ansible.cfg in the folder it runs in: the collection is found by the path
    return subprocess.run([ANSIBLE_DOC, "-t", "module", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT / "ansible_collections", timeout=300, check=False)


def documented(name: str) -> dict:
    """``ansible-doc --json``'s entry for one module; fails the test on any error or warning."""
    done = ansible_doc("--json", f"v100box.llm.{name}")
    assert done.returncode == 0 and not complaints(done, name), done.stderr
    entry = json.loads(done.stdout).get(f"v100box.llm.{name}")
    assert entry and entry.get("doc"), f"ansible-doc found no documentation for {name}:\n{done.stderr}"
    return entry


def complaints(done: subprocess.CompletedProcess[str], name: str) -> list[str]:
    """ansible-doc's errors and warnings about one module (each names the module it is about)."""
    return [line for line in done.stderr.splitlines()
            if line.startswith(("[ERROR]", "[WARNING]", "[DEPRECATION WARNING]")) and f".{name}" in line]


def text_problems(doc: object, where: str = "") -> list[str]:
    """Every description or short_description that is not text or a list of text, with where it is."""
    found = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            here = f"{where}.{key}" if where else str(key)
            if key in ("description", "short_description"):
                items = value if isinstance(value, list) else [value]
                found += [f"{here}: {item!r}" for item in items if not isinstance(item, str)]
            else:
                found += text_problems(value, here)
    elif isinstance(doc, list):
        for item in doc:
            found += text_problems(item, where)
    return found


@pytest.mark.parametrize("name", NAMES)
def test_ansible_doc_reads_the_module_without_a_complaint(name):
    entry = documented(name)
    problems = text_problems(entry["doc"]) + text_problems(entry.get("return") or {}, "RETURN")
    assert not problems, problems
    assert entry["doc"]["module"] == name and entry.get("return"), f"{name} documents no RETURN"


@pytest.mark.parametrize("name", NAMES)
def test_the_examples_are_tasks_that_call_the_module_by_its_full_name(name):
    tasks = yaml.safe_load(documented(name).get("examples") or "")
    assert isinstance(tasks, list) and tasks, f"{name}: EXAMPLES holds no task list"
    for task in tasks:
        assert task.get("name") and f"v100box.llm.{name}" in task, f"{name}: an example does not call " \
                                                                    f"v100box.llm.{name}: {task}"


def test_every_module_reads_as_text_too():
    done = ansible_doc(*(f"v100box.llm.{name}" for name in NAMES))
    assert done.returncode == 0 and not [line for line in done.stderr.splitlines() if line.startswith("[")], \
        done.stderr


def test_a_windows_module_has_a_documented_twin():
    for script in MODULES.glob("*.ps1"):
        assert script.with_suffix(".py").is_file(), f"{script.name} has no .py twin holding its documentation"
