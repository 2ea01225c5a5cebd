"""execution-environment.yml (ansible-builder v3) holds what the collection's playbooks need on the control side.

What the roles and playbooks name (collections by their FQCN module, role, filter and lookup names), what the
collection's plugins import (found by their syntax trees), the connections a fleet can ask for, and the versions
requirements.lock pins are read from the project and checked against the file; then ansible-builder writes the build
context from it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path, PurePosixPath
from typing import Any, get_args

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from controller.model.fleet import Box

PROJECT = Path(__file__).resolve().parents[2]
EE_FILE = PROJECT / "execution-environment.yml"
COLLECTION = PROJECT / "ansible_collections" / "v100box" / "llm"
PINNED_COLLECTIONS = PROJECT / "collections" / "requirements.yml"
LOCK = PROJECT / "requirements.lock"

NAME = r"[a-z_][a-z0-9_]*"
FQCN = re.compile(rf"({NAME})\.({NAME})\.{NAME}")
# A collection's filter or test after a pipe or `is`, or its lookup by name, inside a Jinja expression.
JINJA_FQCN = re.compile(rf"(?:\||\bis\b|\b(?:lookup|query|q)\(\s*['\"])\s*({NAME}\.{NAME})\.{NAME}")
CORE = {"ansible.builtin", "ansible.legacy"}  # part of ansible-core
ROLE_ACTIONS = {"include_role", "import_role"}
# What Ansible's connection for each transport a fleet box may name needs in the image, besides ansible-core.
CONNECTION_NEEDS = {"ssh": ("system", "openssh"), "winrm": ("python", "pywinrm"), "local": None}


def ee() -> dict[str, Any]:
    return yaml.safe_load(EE_FILE.read_text())


def locked_versions() -> dict[str, str]:
    return {canonicalize_name(name): version
            for name, version in re.findall(r"^([A-Za-z0-9._-]+)==([^\s;\\]+)", LOCK.read_text(), flags=re.MULTILINE)}


def galaxy_entries() -> list[dict[str, Any]]:
    return ee()["dependencies"]["galaxy"]["collections"]


def python_requirements() -> dict[str, Requirement]:
    return {canonicalize_name(req.name): req for req in map(Requirement, ee()["dependencies"]["python"])}


def _fqcn_collection(name: Any) -> str | None:
    match = FQCN.fullmatch(name) if isinstance(name, str) else None
    return f"{match.group(1)}.{match.group(2)}" if match else None


def _collections_in(node: Any) -> set[str]:
    """The collections a parsed YAML document names: task and handler modules, roles of plays, include_role and
    import_role, playbooks imported by name, role dependencies, and filters, tests and lookups in Jinja."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            used = _fqcn_collection(key)
            if used:
                found.add(used)
                if key.rsplit(".", 1)[1] in ROLE_ACTIONS and isinstance(value, dict):
                    found |= {_fqcn_collection(value.get("name"))} - {None}
                if key.endswith(".import_playbook"):
                    found |= {_fqcn_collection(value)} - {None}
            if key in ("roles", "dependencies") and isinstance(value, list):
                for role in value:
                    name = role.get("role", role.get("name")) if isinstance(role, dict) else role
                    found |= {_fqcn_collection(name)} - {None}
            found |= _collections_in(value)
    elif isinstance(node, list):
        for item in node:
            found |= _collections_in(item)
    elif isinstance(node, str) and ("{{" in node or "{%" in node):
        found |= set(JINJA_FQCN.findall(node))
    return found


def collections_in_use() -> set[str]:
    used: set[str] = set()
    files = [*(COLLECTION / "roles").rglob("*.yml"), *(COLLECTION / "playbooks").rglob("*.yml")]
    for path in files:
        if "molecule" in path.relative_to(COLLECTION).parts:  # the lab's scenarios: not shipped, not run by AWX
            continue
        for document in yaml.safe_load_all(path.read_text()):
            used |= _collections_in(document)
    return used - CORE


def plugin_imports() -> tuple[set[str], set[str]]:
    """What the collection's plugins import, found by their syntax trees (lazy imports inside functions too):
    the top-level Python modules outside the standard library and ansible-core, and the collections
    (``ansible_collections.<namespace>.<name>``)."""
    modules: set[str] = set()
    collections: set[str] = set()
    for path in (COLLECTION / "plugins").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "ansible_collections" and len(parts) > 2:
                    collections.add(f"{parts[1]}.{parts[2]}")
                elif parts[0] not in sys.stdlib_module_names and parts[0] not in ("ansible", "ansible_collections"):
                    modules.add(parts[0])
    return modules, collections


def test_every_collection_the_roles_and_playbooks_use_is_installed():
    used = collections_in_use()
    # The scan finds the real uses: Windows modules, community modules, the project's own roles and modules.
    assert {"ansible.windows", "community.general", "community.windows", "v100box.llm"} <= used, used
    installed = {entry["name"] for entry in galaxy_entries()}
    assert used <= installed, f"add {sorted(used - installed)} to execution-environment.yml's galaxy collections"


def test_public_collections_are_the_pinned_versions():
    pinned = {item["name"]: item["version"] for item in yaml.safe_load(PINNED_COLLECTIONS.read_text())["collections"]}
    for entry in galaxy_entries():
        if entry["name"] == "v100box.llm":
            continue
        assert entry.get("version") == pinned.get(entry["name"]), (
            f"{entry['name']}: execution-environment.yml has {entry.get('version')}, collections/requirements.yml "
            f"{pinned.get(entry['name'])}")


def test_v100box_llm_is_installed_from_this_clone():
    """Galaxy installs v100box.llm from a folder of the build context that holds this clone's collection, every file
    where the collection has it, all of what galaxy would pack (its tests are ansible-test's, not shipped)."""
    (entry,) = [entry for entry in galaxy_entries() if entry["name"] == "v100box.llm"]
    assert entry["type"] == "dir"
    folder = PurePosixPath(entry["source"].removeprefix("./"))
    copied: set[str] = set()
    for item in ee()["additional_build_files"]:
        dest = PurePosixPath(item["dest"])
        if dest != folder and folder not in dest.parents:
            continue
        source = (PROJECT / item["src"]).resolve()
        placed = dest.relative_to(folder) / source.name if source.is_file() else dest.relative_to(folder)
        assert PurePosixPath(source.relative_to(COLLECTION.resolve()).as_posix()) == placed, item
        copied.add(placed.parts[0])
    shipped = {path.name for path in COLLECTION.iterdir() if path.name != "tests" and not path.name.startswith(".")}
    assert copied == shipped, f"additional_build_files: copy {sorted(shipped - copied)} too"
    galaxy = yaml.safe_load((COLLECTION / "galaxy.yml").read_text())
    assert (galaxy["namespace"], galaxy["name"]) == ("v100box", "llm")


def test_the_python_packages_the_plugins_import_are_installed():
    modules, collections = plugin_imports()
    assert "json5" in modules and "v100box.llm" in collections, (modules, collections)  # the scan finds real imports
    installed = {entry["name"] for entry in galaxy_entries()}
    assert collections <= installed, f"add {sorted(collections - installed)} to execution-environment.yml's galaxy"
    distributions = packages_distributions()
    unknown = {module for module in modules if module not in distributions}
    assert not unknown, f"the plugins import {sorted(unknown)}, which no installed distribution provides"
    wanted = {canonicalize_name(distributions[module][0]) for module in modules}
    requirements = python_requirements()
    assert wanted <= set(requirements), f"add {sorted(wanted - set(requirements))} to execution-environment.yml's python"


def test_every_transport_a_fleet_can_name_has_its_connection():
    transports = get_args(Box.model_fields["transport"].annotation)
    assert set(transports) == set(CONNECTION_NEEDS), "a new transport: say what its connection needs in the image"
    system = " ".join(ee()["dependencies"]["system"])
    for need in filter(None, CONNECTION_NEEDS.values()):
        kind, name = need
        if kind == "python":
            assert name in python_requirements(), name
        else:
            assert re.search(rf"\b{name}-clients? \[platform:rpm\]", system), system
            assert re.search(rf"\b{name}-client \[platform:dpkg\]", system), system


def test_versions_are_the_locked_ones():
    pins = locked_versions()
    dependencies = ee()["dependencies"]
    for key, name in (("ansible_core", "ansible-core"), ("ansible_runner", "ansible-runner")):
        requirement = Requirement(dependencies[key]["package_pip"])
        assert canonicalize_name(requirement.name) == name and str(requirement.specifier) == f"=={pins[name]}", (
            f"{key}: {requirement}, requirements.lock pins {name}=={pins[name]}")
    for name, requirement in python_requirements().items():
        assert str(requirement.specifier) == f"=={pins[name]}", f"{requirement}: requirements.lock pins {pins[name]}"


@pytest.mark.slow
def test_ansible_builder_writes_the_build_context(tmp_path):
    builder = Path(sys.executable).with_name("ansible-builder")
    done = subprocess.run([str(builder), "create", "--file", str(EE_FILE), "--context", str(tmp_path / "context"),
                           "--output-filename", "Containerfile"], cwd=PROJECT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "No matches" not in done.stdout + done.stderr  # every additional build file exists
    built = tmp_path / "context" / "_build"
    containerfile = (tmp_path / "context" / "Containerfile").read_text()
    assert f"ansible-core=={locked_versions()['ansible-core']}" in containerfile
    requirements = yaml.safe_load((built / "requirements.yml").read_text())["collections"]
    assert {entry["name"] for entry in requirements} == {entry["name"] for entry in galaxy_entries()}
    (own,) = [entry for entry in requirements if entry["name"] == "v100box.llm"]
    # The galaxy stage installs from _build/: the collection is there as galaxy would pack it, without its tests.
    copied = built / own["source"]
    shipped = {path.name for path in COLLECTION.iterdir() if path.name != "tests" and not path.name.startswith(".")}
    assert {path.name for path in copied.iterdir()} == shipped
    assert (copied / "plugins" / "filter" / "v100box.py").read_bytes() == \
        (COLLECTION / "plugins" / "filter" / "v100box.py").read_bytes()
    listed = {canonicalize_name(Requirement(line).name)
              for line in (built / "requirements.txt").read_text().splitlines() if line.strip()}
    assert listed == set(python_requirements())
