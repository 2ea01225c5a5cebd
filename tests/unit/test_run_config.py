"""The Ansible settings of the controller's runs come with the package (controller/data/ansible.cfg), so an installed
controller (a wheel, no clone) runs as a clone does: the clone's ansible.cfg settings, less its paths, which the run's
environment gives (controller/stages/runner.py)."""

from __future__ import annotations

import configparser
import json
import subprocess
import sys
from pathlib import Path

import pytest

import controller
from controller.stages.runner import RUN_CONFIG, base_env, run_env

REPO = Path(__file__).resolve().parents[2]
# What a clone's ansible.cfg names by path, or the runner's environment sets (ssh_env's ssh_args, the collections).
PATH_SETTINGS = {("defaults", "collections_path"), ("defaults", "roles_path"), ("defaults", "library"),
                 ("defaults", "filter_plugins"), ("defaults", "inventory"), ("ssh_connection", "ssh_args")}


def settings(path: Path) -> dict[tuple[str, str], str]:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(path.read_text())
    return {(section, key): value for section in parser.sections() for key, value in parser.items(section)}


def test_runs_read_the_config_shipped_in_the_package():
    config = Path(base_env()["ANSIBLE_CONFIG"])
    assert config == RUN_CONFIG and config.is_file()
    assert config.is_relative_to(Path(controller.__file__).resolve().parent)  # installed with the package


def test_the_shipped_config_is_the_clones_less_its_paths():
    clone = {key: value for key, value in settings(REPO / "ansible.cfg").items() if key not in PATH_SETTINGS}
    assert settings(RUN_CONFIG) == clone


@pytest.mark.slow
def test_an_ansible_cfg_in_the_working_folder_does_not_change_a_run(tmp_path):
    """Without ANSIBLE_CONFIG Ansible would read ./ansible.cfg first: a run started from any folder reads its own."""
    (tmp_path / "ansible.cfg").write_text("[defaults]\nforks = 3\nhost_key_checking = False\n")
    done = subprocess.run([str(Path(sys.executable).with_name("ansible-config")), "dump", "--only-changed", "--format",
                           "json"], cwd=tmp_path, env=run_env(tmp_path), capture_output=True, text=True, timeout=120,
                          check=True)
    dumped = {item["name"]: item["value"] for item in json.loads(done.stdout) if "name" in item}
    assert dumped["CONFIG_FILE"] == str(RUN_CONFIG)
    assert dumped["DEFAULT_FORKS"] == 10 and dumped["HOST_KEY_CHECKING"] is True
