"""Every role, module and filter of the collection is called by its full name (v100box.llm.<name>) in the
collection's roles, playbooks, molecule scenarios and templates, so each resolves the same from a clone, an
installed copy or another project's playbook, and never through Ansible's legacy search paths."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COLLECTION = ROOT / "ansible_collections/v100box/llm"
PREFIX = "v100box.llm."
ROLES = {path.name for path in (COLLECTION / "roles").iterdir() if path.is_dir()}
MODULES = {path.stem for path in (COLLECTION / "plugins/modules").iterdir() if path.suffix in (".py", ".ps1")}
FILTER_SOURCE = (COLLECTION / "plugins/filter/v100box.py").read_text()
FILTERS = set(re.findall(r'"(\w+)":\s*\w+', FILTER_SOURCE[FILTER_SOURCE.index("def filters"):]))
ROLE_KEYS = {"include_role", "import_role", "ansible.builtin.include_role", "ansible.builtin.import_role"}
YAML_FILES = sorted([*COLLECTION.glob("roles/**/*.yml"), *COLLECTION.glob("playbooks/*.yml")])
TEXT_FILES = sorted([*YAML_FILES, *COLLECTION.glob("roles/*/templates/**/*.j2")])


class _Loader(yaml.SafeLoader):
    """YAML as Ansible reads it, with its tags (!unsafe, !vault) taken as their plain values."""


_Loader.add_multi_constructor("!", lambda loader, _tag, node: loader.construct_scalar(node)
                              if isinstance(node, yaml.ScalarNode) else None)


def _short_names(node: object, where: str) -> list[str]:
    """Roles and modules of the collection named without the collection, anywhere in a YAML document."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, str) and key.removeprefix("ansible.legacy.") in MODULES:
                found.append(f"{where}: module {key}")
            if key in ROLE_KEYS and isinstance(value, dict) and value.get("name") in ROLES:
                found.append(f"{where}: {key} {value['name']}")
            if key == "roles" and isinstance(value, list):
                for entry in value:
                    name = entry if isinstance(entry, str) else (entry or {}).get("role", (entry or {}).get("name"))
                    if name in ROLES:
                        found.append(f"{where}: role {name}")
            found += _short_names(value, where)
    elif isinstance(node, list):
        for item in node:
            found += _short_names(item, where)
    return found


def test_the_collection_s_parts_are_known():
    assert {"llama_service", "gguf_model", "nvidia_driver"} <= ROLES
    assert {"gguf_download", "llama_api_check", "safe_unpack"} <= MODULES
    assert {"systemd_quote", "reachable_host", "llama_gpu_minors"} <= FILTERS


def test_roles_and_modules_are_called_by_their_full_names():
    short = []
    for path in YAML_FILES:
        for document in yaml.load_all(path.read_text(), Loader=_Loader):
            short += _short_names(document, str(path.relative_to(COLLECTION)))
    assert short == []


def test_filters_are_called_by_their_full_names():
    names = "|".join(sorted(FILTERS))
    piped = re.compile(rf"\|\s*({names})\b")
    mapped = re.compile(rf"\b(?:map|select|reject)\(\s*['\"]({names})['\"]")
    short = [f"{path.relative_to(COLLECTION)}: {match}" for path in TEXT_FILES
             for match in piped.findall(path.read_text()) + mapped.findall(path.read_text())]
    assert short == []
