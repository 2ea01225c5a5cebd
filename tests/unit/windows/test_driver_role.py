"""The parts of roles/win_nvidia_driver that decide before touching a host, run by Ansible on localhost."""

import json

import pytest

from tests.unit.windows.ansible_local import run_playbook

# Each module runs ansible-playbook on localhost: seconds per run.
pytestmark = pytest.mark.slow

PLAY = [{"name": "Driver", "hosts": "localhost", "gather_facts": False, "roles": [{"role": "win_nvidia_driver"}]}]


def custom_stats(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{") :])["global_custom_stats"]


def test_box_without_a_v100_is_skipped_with_a_message(tmp_path):
    gpus = [{"index": 0, "name": "Tesla P40", "pci_bus_id": "00000000:01:00.0", "driver_model": "TCC"}]
    result = run_playbook(tmp_path, PLAY, {"win_nvidia_driver_gpus": gpus}, json_output=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No Tesla V100 among the probed GPUs (Tesla P40)" in result.stdout
    report = custom_stats(result.stdout)["win_nvidia_driver"]["localhost"]
    assert report["skipped"] is True
    assert report["wanted_version"] == "573.96"


def test_driver_outside_the_window_is_refused_before_anything_runs(tmp_path):
    gpus = [{"index": 0, "name": "Tesla V100-SXM2-16GB", "pci_bus_id": "00000000:01:00.0", "driver_model": "TCC"}]
    for version in ("596.36", "538.78"):
        result = run_playbook(tmp_path, PLAY, {"win_nvidia_driver_gpus": gpus, "win_nvidia_driver_version": version})
        assert result.returncode != 0
        assert f"win_nvidia_driver_version is '{version}'" in result.stdout
        assert "Set 573.96" in result.stdout


def test_unknown_mode_is_refused_by_the_argument_spec(tmp_path):
    result = run_playbook(tmp_path, PLAY, {"win_nvidia_driver_mode": "wddm"})
    assert result.returncode != 0
    assert "win_nvidia_driver_mode" in result.stdout and "tcc" in result.stdout


def test_unmanaged_driver_is_left_alone(tmp_path):
    gpus = [{"index": 0, "name": "Tesla V100-PCIE-32GB", "pci_bus_id": "00000000:02:00.0", "driver_model": "WDDM"}]
    extra = {"win_nvidia_driver_gpus": gpus, "win_nvidia_driver_manage": False}
    result = run_playbook(tmp_path, PLAY, extra, json_output=True)
    assert result.returncode == 0, result.stdout + result.stderr
    report = custom_stats(result.stdout)["win_nvidia_driver"]["localhost"]
    assert report["skipped"] is True and "left to the box owner" in report["message"]
