"""PowerShell syntax checks with tree-sitter-powershell, and the scripts embedded in the roles' Windows tasks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import tree_sitter
import tree_sitter_powershell
import yaml

from tests.unit.windows.ansible_local import MERGED_ROLES

PARSER = tree_sitter.Parser(tree_sitter.Language(tree_sitter_powershell.language()))
SCRIPT_MODULES = {
    "ansible.windows.win_powershell": "script",
    "ansible.windows.win_shell": "cmd",
}


def parse_errors(script: str) -> list[str]:
    """Lines and text of the nodes tree-sitter could not parse; empty for a valid script."""
    tree = PARSER.parse(script.encode())
    errors: list[str] = []

    def walk(node):
        if node.is_error or node.is_missing:
            errors.append(f"line {node.start_point[0] + 1}: {node.text.decode(errors='replace')[:80]!r}")
        for child in node.children:
            walk(child)

    walk(tree.root_node)
    if tree.root_node.has_error and not errors:
        errors.append("unlocated parse error")
    return errors


def _tasks(items) -> Iterator[dict]:
    for task in items or []:
        yield task
        for section in ("block", "rescue", "always"):
            yield from _tasks(task.get(section))


def role_scripts() -> Iterator[tuple[str, str]]:
    """(where, script) for every win_powershell/win_shell body in the roles' tasks and handlers."""
    for role in MERGED_ROLES:
        for path in sorted([*role.glob("tasks/*.yml"), *role.glob("handlers/*.yml")]):
            for task in _tasks(yaml.safe_load(path.read_text())):
                for module, key in SCRIPT_MODULES.items():
                    if module in task:
                        body = task[module]
                        script = body if isinstance(body, str) else body.get(key) or body.get("_raw_params")
                        yield f"{Path(path).relative_to(role.parent)}: {task['name']}", script
