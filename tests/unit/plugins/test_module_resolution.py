"""One task name, v100box.llm.llama_api_check, runs llama_api_check.py on a Linux box and win_llama_api_check.ps1 on a
Windows box: the collection's action plugin of that name runs the Windows module under its own name on a PowerShell
host. The .ps1 must not share the .py's name: a lookup by name alone (Ansible's with no extension, and the mitogen
strategy's for every module) takes the .ps1 of a pair, first in sort order."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from controller.stages.strategy import LINEAR, MITOGEN, environment

ROOT = Path(__file__).resolve().parents[3]
MODULES = ROOT / "ansible_collections/v100box/llm/plugins/modules"
RESOLVE = """
import json
from ansible.plugins.loader import action_loader, init_plugin_loader, module_loader
init_plugin_loader()
found = {suffix: module_loader.find_plugin_with_context("v100box.llm.llama_api_check", suffix).plugin_resolved_path
         for suffix in (".ps1", ".py", "")}
found["windows"] = module_loader.find_plugin_with_context("v100box.llm.win_llama_api_check", ".ps1").plugin_resolved_path
found["action"] = action_loader.find_plugin_with_context("v100box.llm.llama_api_check").plugin_resolved_path
print(json.dumps(found))
"""


def ansible_env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(ROOT), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"), "ANSIBLE_HOME": str(tmp_path / "home")}
    env.pop("ANSIBLE_CONFIG", None)
    return env


def test_each_shell_gets_its_own_file(tmp_path):
    done = subprocess.run([sys.executable, "-c", RESOLVE], cwd=tmp_path, env=ansible_env(tmp_path),
                          capture_output=True, text=True, check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found[".ps1"] is None  # a PowerShell connection finds no .ps1 under the Linux module's name
    assert found[".py"] == found[""] == str(MODULES / "llama_api_check.py")  # any lookup by the name gets the .py
    assert found["windows"] == str(MODULES / "win_llama_api_check.ps1")  # what the action runs on a PowerShell host
    assert found["action"] == str(ROOT / "ansible_collections/v100box/llm/plugins/action/llama_api_check.py")


@pytest.mark.parametrize("strategy", [LINEAR, MITOGEN])
def test_a_linux_host_runs_the_python_module(tmp_path, strategy):
    """Through ansible-playbook, as a Linux box: the Python module answers (a dead port: health unreachable), with
    the collection's module_utils shipped in its payload; under the plain strategy and under mitogen's (which the
    molecule scenarios use), which looks the module up by its name alone."""
    (tmp_path / "play.yml").write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - name: Check a server that is not there\n"
        "      v100box.llm.llama_api_check: {base_url: 'http://127.0.0.1:9', model: tiny, timeout: 2}\n"
        "      register: answer\n      ignore_errors: true\n"
        "    - name: Show it\n      ansible.builtin.debug: {var: answer}\n")
    env = {**ansible_env(tmp_path), "ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json",
           **environment(strategy)}
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", f"ansible_python_interpreter={sys.executable}", str(tmp_path / "play.yml")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=120)
    answer = json.loads(done.stdout)["plays"][0]["tasks"][1]["hosts"]["localhost"]["answer"]
    assert answer["health"] == "unreachable" and "/health" in answer["msg"], answer


def _module_files(tmp_path: Path, inventory: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "check.yml").write_text(
        "- hosts: all\n  gather_facts: false\n  tasks:\n"
        "    - name: Check a server that is not there\n"
        "      v100box.llm.llama_api_check: {base_url: 'http://127.0.0.1:9', model: tiny, timeout: 2}\n"
        "      ignore_errors: true\n")
    return subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-vvv", "-i", inventory, *args,
                           str(tmp_path / "check.yml")], cwd=tmp_path, env=ansible_env(tmp_path), capture_output=True,
                          text=True, check=False, timeout=120)


def _used(output: str) -> list[str]:
    return sorted(re.findall(r"^Using module file (\S+)$", output, flags=re.MULTILINE))


def test_a_windows_host_gets_the_ps1_file(tmp_path):
    """A PowerShell host over SSH: Ansible picks the module's file before it connects, so a closed port (the task
    ends unreachable) still shows which file it would have sent."""
    done = _module_files(tmp_path, "127.0.0.1,", "-e", "ansible_connection=ssh", "-e", "ansible_port=9",
                         "-e", "ansible_shell_type=powershell")
    assert _used(done.stdout) == [str(MODULES / "win_llama_api_check.ps1")], done.stdout[-3000:]
    assert "UNREACHABLE" in done.stdout


def test_one_run_over_both_kinds_of_host_gives_each_its_file(tmp_path):
    """Linux and Windows boxes in one play, as site.yml runs them: the POSIX host runs the .py (it answers) while
    the PowerShell host gets win_llama_api_check.ps1."""
    (tmp_path / "hosts.yml").write_text(
        "all:\n  hosts:\n"
        f"    linux: {{ansible_connection: local, ansible_python_interpreter: {sys.executable}}}\n"
        "    windows: {ansible_host: 127.0.0.1, ansible_connection: ssh, ansible_port: 9,"
        " ansible_shell_type: powershell}\n")
    done = _module_files(tmp_path, str(tmp_path / "hosts.yml"))
    assert _used(done.stdout) == [str(MODULES / "llama_api_check.py"), str(MODULES / "win_llama_api_check.ps1")], \
        done.stdout[-3000:]
    assert re.search(r"^linux\s+: ok=1 .*failed=0 .*ignored=1", done.stdout, flags=re.MULTILINE), done.stdout[-1500:]
    assert re.search(r"^windows\s+: .*unreachable=1", done.stdout, flags=re.MULTILINE), done.stdout[-1500:]
