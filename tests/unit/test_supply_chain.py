"""What the project runs with is pinned: Python packages by hash (requirements*.lock, written by scripts/lock.sh)
and Ansible collections by version (collections/requirements.yml), and what is installed is what is pinned."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT = Path(__file__).resolve().parents[2]
LOCK = PROJECT / "requirements.lock"
PIP_LOCK = PROJECT / "requirements-pip.lock"
COLLECTIONS = PROJECT / "collections" / "requirements.yml"
# <namespace>.<collection>.<plugin>, for every namespace but ansible.builtin's.
# not ansible-core's own packages, nor a Python import of one (from ansible.cli.playbook import main)
FQCN = re.compile(r"(?<!from )(?<!import )\b((?:ansible\.(?!builtin\b|plugins\b|module_utils\b)|community\.|containers\.)"
                  r"[a-z_]+)\.[a-z_]+\b")


def locked(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) for each requirement of a lock file."""
    pins: dict[str, tuple[str, list[str]]] = {}
    for entry in re.split(r"\n(?=\S)", path.read_text()):
        if entry.startswith("#") or not entry.strip():
            continue
        head = entry.split("\\")[0].strip()
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s;]+)", head)
        assert match, f"{path.name}: {head!r} is not pinned with =="
        pins[canonicalize_name(match.group(1))] = (match.group(2), re.findall(r"--hash=sha256:([0-9a-f]{64})", entry))
    return pins


def test_every_locked_package_is_pinned_with_hashes():
    for path in (LOCK, PIP_LOCK):
        pins = locked(path)
        assert pins, path.name
        for name, (_, hashes) in pins.items():
            assert hashes, f"{path.name}: {name} has no --hash"
    assert set(locked(PIP_LOCK)) == {"pip"}


def test_the_lock_covers_pyproject():
    """A dependency added to pyproject.toml without running scripts/lock.sh fails here (and in bootstrap)."""
    project = tomllib.loads((PROJECT / "pyproject.toml").read_text())
    wanted = [*project["project"]["dependencies"], *project["build-system"]["requires"]]
    for extra in ("test", "lint"):
        wanted += project["project"]["optional-dependencies"][extra]
    pins = locked(LOCK)
    for text in wanted:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is not in requirements.lock: run scripts/lock.sh"
        assert requirement.specifier.contains(pins[name][0], prereleases=True), (
            f"requirements.lock pins {name} {pins[name][0]}, outside {requirement.specifier}: run scripts/lock.sh")


def test_this_environment_is_the_locked_one():
    pins = locked(LOCK)
    for name in ("ansible", "ansible-core", "ansible-runner", "pydantic", "pytest", "ansible-lint"):
        assert metadata.version(name) == pins[name][0], f"{name}: installed {metadata.version(name)}, locked "\
            f"{pins[name][0]}: run scripts/bootstrap.sh"


def _collections_in_use() -> set[str]:
    used = set()
    collection = "ansible_collections/v100box/llm"
    for folder in (f"{collection}/roles", f"{collection}/playbooks", f"{collection}/plugins", "tests", ".config"):
        for path in (PROJECT / folder).rglob("*"):
            if path.suffix in (".yml", ".yaml", ".py", ".j2") and path.is_file() and path != Path(__file__):
                used |= set(FQCN.findall(path.read_text(errors="replace")))
    return used


def test_every_collection_in_use_is_pinned():
    pinned = {item["name"] for item in yaml.safe_load(COLLECTIONS.read_text())["collections"]}
    used = _collections_in_use()
    assert {"ansible.windows", "community.windows", "community.general"} <= used  # the scan finds real uses
    assert used <= pinned, f"add {sorted(used - pinned)} to collections/requirements.yml"


@pytest.mark.slow
def test_ansible_loads_the_pinned_collection_versions():
    pinned = {item["name"]: item["version"] for item in yaml.safe_load(COLLECTIONS.read_text())["collections"]}
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", version) for version in pinned.values()), "pin exact versions"
    galaxy = Path(sys.executable).with_name("ansible-galaxy")
    env = dict(os.environ, ANSIBLE_CONFIG=str(PROJECT / "ansible.cfg"))
    listing = subprocess.run([str(galaxy), "collection", "list", "--format", "json"], cwd=PROJECT, env=env,
                             capture_output=True, text=True, check=True, timeout=120)
    # The listing follows Ansible's search order: the first folder holding a collection is the one loaded.
    loaded: dict[str, str] = {}
    for collections in json.loads(listing.stdout).values():
        for name, info in collections.items():
            loaded.setdefault(name, info["version"])
    for name, version in pinned.items():
        assert loaded.get(name) == version, f"Ansible loads {name} {loaded.get(name)}, pinned {version}"
