"""The parts of roles/nvidia_driver's Windows path that decide before touching a host, run by Ansible on localhost."""

import json

import pytest

from controller.model import rules
from tests.unit.windows.ansible_local import WINDOWS_FACTS, run_playbook

# Each module runs ansible-playbook on localhost: seconds per run.
pytestmark = pytest.mark.slow

PLAY = [{"name": "Driver", "hosts": "localhost", "gather_facts": False, "roles": [{"role": "v100box.llm.nvidia_driver"}]}]
INSTALLER = {"version": rules.WINDOWS_DRIVER, "url": "https://downloads.example/driver.exe", "sha256": "ab" * 32}
BASE = {"nvidia_driver_window": WINDOWS_FACTS["nvidia_driver_window"], "nvidia_driver_installer": INSTALLER}


def custom_stats(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{") :])["global_custom_stats"]


def test_box_without_a_v100_is_skipped_with_a_message(tmp_path):
    gpus = [{"index": 0, "name": "Tesla P40", "pci_bus_id": "00000000:01:00.0", "driver_model": "TCC", "is_v100": False}]
    result = run_playbook(tmp_path, PLAY, {**BASE, "nvidia_driver_gpus": gpus}, json_output=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no V100 among the probed GPUs (Tesla P40)" in result.stdout
    report = custom_stats(result.stdout)["nvidia_driver"]["localhost"]
    assert report["status"] == "skipped" and report["reboot_required"] is False


def test_the_v100_decision_is_the_controllers(tmp_path):
    # A name that says V100 is not enough: the role follows is_v100, which controller.model.rules decided.
    gpus = [{"index": 0, "name": "Tesla V100-SXM2-16GB", "pci_bus_id": "00000000:01:00.0", "is_v100": False}]
    result = run_playbook(tmp_path, PLAY, {**BASE, "nvidia_driver_gpus": gpus}, json_output=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert custom_stats(result.stdout)["nvidia_driver"]["localhost"]["status"] == "skipped"


def test_driver_outside_the_window_is_refused_before_anything_runs(tmp_path):
    gpus = [{"index": 0, "name": "Tesla V100-SXM2-16GB", "pci_bus_id": "00000000:01:00.0", "driver_model": "TCC",
             "is_v100": True}]
    for version in ("596.36", "538.78"):
        extra = {**BASE, "nvidia_driver_gpus": gpus, "nvidia_driver_installer": {**INSTALLER, "version": version}}
        result = run_playbook(tmp_path, PLAY, extra)
        assert result.returncode != 0
        assert f"nvidia_driver_installer.version is '{version}'" in result.stdout
        assert f"in the {rules.DRIVER_WINDOW} window" in result.stdout


def test_the_window_comes_from_the_inventory(tmp_path):
    result = run_playbook(tmp_path, PLAY, {"nvidia_driver_installer": INSTALLER})
    assert result.returncode != 0
    # The argument spec stops the role before any task: the spec requires it (and a default reads it).
    assert "'nvidia_driver_window' is undefined" in result.stdout or "nvidia_driver_window" in result.stdout and \
        "required" in result.stdout


def test_unknown_mode_is_refused_by_the_argument_spec(tmp_path):
    result = run_playbook(tmp_path, PLAY, {**BASE, "nvidia_driver_mode": "wddm"})
    assert result.returncode != 0
    assert "nvidia_driver_mode" in result.stdout and "tcc" in result.stdout


def test_unmanaged_driver_is_left_alone(tmp_path):
    gpus = [{"index": 0, "name": "Tesla V100-PCIE-32GB", "pci_bus_id": "00000000:02:00.0", "driver_model": "WDDM",
             "is_v100": True}]
    extra = {**BASE, "nvidia_driver_gpus": gpus, "nvidia_driver_manage": False}
    result = run_playbook(tmp_path, PLAY, extra, json_output=True)
    assert result.returncode == 0, result.stdout + result.stderr
    report = custom_stats(result.stdout)["nvidia_driver"]["localhost"]
    assert report["status"] == "unmanaged" and "left to its owner" in report["message"]
