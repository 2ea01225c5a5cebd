"""One module name, llama_api_check, runs the .py on a Linux box and the .ps1 on a Windows box, whichever Ansible
looks up first: the Windows twin lives in a library folder that ansible.cfg lists after plugins/modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RESOLVE = """
import json, sys
from ansible.plugins.loader import init_plugin_loader, module_loader
init_plugin_loader()
found = {}
for suffix in sys.argv[1:]:
    found[suffix or "posix"] = module_loader.find_plugin_with_context("llama_api_check", suffix).plugin_resolved_path
print(json.dumps(found))
"""


@pytest.mark.parametrize("order", [["", ".ps1"], [".ps1", ""]], ids=["posix-first", "windows-first"])
def test_each_shell_gets_its_own_file(order):
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
    done = subprocess.run([sys.executable, "-c", RESOLVE, *order], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"posix": str(ROOT / "ansible_collections/v100box/llm/plugins/modules/llama_api_check.py"),
                     ".ps1": str(ROOT / "ansible_collections/v100box/llm/plugins/modules/llama_api_check.ps1")}


def test_a_linux_host_runs_the_python_module(tmp_path):
    """Through ansible-playbook, as a Linux box: the Python module answers (a dead port: health unreachable)."""
    (tmp_path / "play.yml").write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - name: Check a server that is not there\n"
        "      llama_api_check: {base_url: 'http://127.0.0.1:9', model: tiny, timeout: 2}\n"
        "      register: answer\n      ignore_errors: true\n"
        "    - name: Show it\n      ansible.builtin.debug: {var: answer}\n")
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json"}
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", f"ansible_python_interpreter={sys.executable}", str(tmp_path / "play.yml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=120)
    answer = json.loads(done.stdout)["plays"][0]["tasks"][1]["hosts"]["localhost"]["answer"]
    assert answer["health"] == "unreachable" and "/health" in answer["msg"], answer
