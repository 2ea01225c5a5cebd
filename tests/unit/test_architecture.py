"""ARCHITECTURE.md and the README's layout table name real places, and every part of the package has a home there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[2]
COLLECTION = PROJECT / "ansible_collections/v100box/llm"
PLACE = re.compile(r"`((?:controller|ansible_collections|roles|plugins|playbooks|lab|benchmarks)/[\w./<>-]*)`")
# The documents name the Ansible side's places as the collection does, from its folder: `roles/llama_service`.
IN_COLLECTION = ("roles/", "plugins/", "playbooks/")


def _places(document: str) -> set[str]:
    text = (PROJECT / document).read_text()
    return {match.split(":")[0] for match in PLACE.findall(text) if "<" not in match and "..." not in match}  # placeholders


def _path(place: str) -> Path:
    return (COLLECTION if place.startswith(IN_COLLECTION) else PROJECT) / place


@pytest.mark.parametrize("document", ["ARCHITECTURE.md", "README.md"])
def test_every_place_named_exists(document):
    missing = sorted(place for place in _places(document) if not _path(place).exists())
    assert not missing, f"{document} names places that do not exist: {missing}"


def test_every_package_folder_has_a_home_in_the_architecture():
    text = (PROJECT / "ARCHITECTURE.md").read_text()
    folders = sorted(path.relative_to(PROJECT).as_posix() + "/" for path in (PROJECT / "controller").iterdir()
                     if path.is_dir() and (path / "__init__.py").exists())
    assert folders, "no package folders found"
    unnamed = [folder for folder in folders if f"`{folder}" not in text]
    assert not unnamed, f"ARCHITECTURE.md does not say what these are for: {unnamed}"
    roles = sorted(path.name for path in (PROJECT / "ansible_collections/v100box/llm/roles").iterdir() if path.is_dir())
    assert [role for role in roles if f"`{role}`" not in text] == []
