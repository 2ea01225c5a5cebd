"""playbooks/windows.yml passes Ansible's syntax check and ansible-lint's production profile with the win_* roles."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.windows.ansible_local import PROJECT, WIN_ROLES


def tool(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def test_windows_playbooks_run_the_five_roles_in_order():
    import yaml

    plays = yaml.safe_load((PROJECT / "playbooks" / "windows.yml").read_text())
    assert [play["hosts"] for play in plays] == ["windows"]
    assert [role["role"] for role in plays[0]["roles"]] == [
        "win_nvidia_driver", "win_llama_engine", "win_gguf_model", "win_llama_service",
    ]  # fmt: skip
    verify = {play["hosts"]: play for play in yaml.safe_load((PROJECT / "playbooks" / "verify.yml").read_text())}
    assert [role["role"] for role in verify["windows"]["roles"]] == ["win_llama_verify"]
    site = yaml.safe_load((PROJECT / "playbooks" / "site.yml").read_text())
    assert [play.get("ansible.builtin.import_playbook") for play in site[1:]] == ["windows.yml", "verify.yml"]


def test_windows_playbook_syntax(tmp_path):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("windows:\n  hosts:\n    box9:\n      ansible_connection: winrm\n")
    result = subprocess.run(
        [tool("ansible-playbook"), "--syntax-check", "-i", str(inventory), "playbooks/windows.yml"],
        cwd=PROJECT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_windows_roles_pass_ansible_lint_production():
    result = subprocess.run(
        [tool("ansible-lint"), "--profile", "production", "--nocolor", *map(str, WIN_ROLES), "playbooks/windows.yml"],
        cwd=PROJECT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(WIN_ROLES) == 5


def _module_tasks(items):
    for task in items or []:
        for section in ("block", "rescue", "always"):
            yield from _module_tasks(task.get(section))
        for key, value in task.items():
            if key.startswith(("ansible.windows.", "community.windows.")) and isinstance(value, dict):
                yield key, set(value)


def test_windows_modules_are_called_with_options_they_have():
    import json

    import yaml

    used: dict[str, set[str]] = {}
    for role in WIN_ROLES:
        for path in [*role.glob("tasks/*.yml"), *role.glob("handlers/*.yml")]:
            for module, options in _module_tasks(yaml.safe_load(path.read_text())):
                used.setdefault(module, set()).update(options)
    assert "ansible.windows.win_powershell" in used and "community.windows.win_firewall_rule" in used
    docs = subprocess.run([tool("ansible-doc"), "-j", *sorted(used)], capture_output=True, text=True, check=True)
    documented = {name: set(entry["doc"].get("options", {})) for name, entry in json.loads(docs.stdout).items()}
    assert {
        module: options - documented[module] for module, options in used.items() if options - documented[module]
    } == {}
