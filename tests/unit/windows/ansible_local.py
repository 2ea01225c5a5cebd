"""Run a small playbook on localhost (connection local) with the project's ansible.cfg, roles and collections.

The merged roles pick their Windows tasks from ansible_facts['os_family']: by default each play first records
os_family Windows as a fact, so the roles' Windows paths (preflights, templates) run here without a Windows host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from controller.model import rules

PROJECT = Path(__file__).resolve().parents[3]
ROLES = PROJECT / "ansible_collections/v100box/llm/roles"
ROLE_NAMES = ("nvidia_driver", "llama_engine", "gguf_model", "llama_service", "thermal_guard", "llama_verify")
MERGED_ROLES = [ROLES / name for name in ROLE_NAMES]

# What render passes a Windows box for the facts the controller owns (controller/model/rules.py).
WINDOWS_FACTS = {
    "nvidia_driver_window": rules.driver_window(),
    "gguf_model_dir": rules.DEFAULT_MODEL_DIR["windows"],
    "llama_service_template_dir": rules.TEMPLATE_DIR["windows"],
}

LOOK_LIKE_WINDOWS = {
    "name": "Record that this host is a Windows box",
    "ansible.builtin.set_fact": {"ansible_os_family": "Windows", "cacheable": True},
}


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def run_playbook(tmp_path: Path, plays: list, extra_vars: dict | None = None, json_output: bool = False,
                 windows: bool = True, hosts: dict[str, dict] | None = None, timeout: float = 300):
    """Write the plays and an inventory into tmp_path and run them; returns the finished process. The inventory is
    localhost, or ``hosts`` (name: host variables), each reached over the local connection."""
    if windows:
        plays = [{**play, "pre_tasks": [LOOK_LIKE_WINDOWS, *play.get("pre_tasks", [])]} for play in plays]
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump(plays, sort_keys=False))
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "hosts": {
                        name: {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, **host_vars}
                        for name, host_vars in (hosts or {"localhost": {}}).items()
                    }
                }
            }
        )
    )
    argv = [_bin("ansible-playbook"), "-i", str(inventory), str(playbook)]
    if extra_vars:
        vars_file = tmp_path / "extra.json"
        vars_file.write_text(json.dumps(extra_vars))
        argv += ["-e", f"@{vars_file}"]
    env = dict(os.environ, ANSIBLE_CONFIG=str(PROJECT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    if json_output:
        env |= {"ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json", "ANSIBLE_SHOW_CUSTOM_STATS": "1"}
    return subprocess.run(argv, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def role_vars(role: str) -> list[str]:
    """The defaults and vars files of a role, for vars_files of a rendering play."""
    return [str(ROLES / role / "defaults" / "main.yml"), str(ROLES / role / "vars" / "main.yml")]
