"""llama_box_state reads what status compares: systemctl's blocks, nvidia-smi's CSV by column name, and a model
file against the record gguf_download wrote after checking it (the two modules' functions, on real files)."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from tests.unit.plugins.loader import load_module

PROBES = Path(__file__).resolve().parents[2] / "fixtures" / "probe"


state = load_module("llama_box_state")
download = load_module("gguf_download")

SHOW = """Id=llama-a.service
LoadState=loaded
ActiveState=active
SubState=running
UnitFileState=enabled
FragmentPath=/etc/systemd/system/llama-a.service
DropInPaths=
NeedDaemonReload=no
MainPID=4242

Id=llama-b.service
LoadState=loaded
ActiveState=failed
SubState=failed
UnitFileState=disabled
FragmentPath=/etc/systemd/system/llama-b.service
DropInPaths=/etc/systemd/system/llama-b.service.d/override.conf /run/systemd/system/llama-b.service.d/x.conf
NeedDaemonReload=yes
MainPID=0
"""


def test_systemctl_show_blocks_read_in_the_order_asked():
    units = state.parse_show(SHOW, ["llama-a", "llama-b"])
    assert units["llama-a"] == {"load": "loaded", "active": "active", "sub": "running", "enabled": "enabled",
                                "fragment": "/etc/systemd/system/llama-a.service", "drop_ins": [],
                                "need_reload": False, "main_pid": 4242}
    assert units["llama-b"]["active"] == "failed" and units["llama-b"]["need_reload"] is True
    assert units["llama-b"]["main_pid"] == 0  # systemd's answer for a unit that runs no process
    assert units["llama-b"]["drop_ins"] == ["/etc/systemd/system/llama-b.service.d/override.conf",
                                            "/run/systemd/system/llama-b.service.d/x.conf"]


def test_nvidia_smi_csv_is_read_by_column_name_whatever_the_order():
    # the probe's capture: other columns, no memory.used
    (gpu,) = state.parse_gpus((PROBES / "single-v100-16g-linux" / "nvidia-smi-query.csv").read_text())
    assert gpu == {"index": 0, "name": "Tesla V100-SXM2-16GB", "driver_version": "570.172.08", "temperature_c": 41,
                   "memory_used_mib": None, "memory_total_mib": 16384}
    asked = ("index, name, driver_version, temperature.gpu, memory.used [MiB], memory.total [MiB]\n"
             "0, Tesla V100-PCIE-32GB, 580.82.07, 52, 20480 MiB, 32768 MiB\n"
             "1, Tesla V100-PCIE-32GB, 580.82.07, [N/A], 0 MiB, 32768 MiB\n")
    first, second = state.parse_gpus(asked)
    assert first["memory_used_mib"] == 20480 and first["temperature_c"] == 52
    assert second["temperature_c"] is None and second["index"] == 1


def test_a_model_file_matches_its_install_record_until_it_is_replaced(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + os.urandom(4096))
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    assert state.read_file(str(model))["marker"] is None  # never checked: no record
    download.write_marker(str(model), sha)
    found = state.read_file(str(model))
    assert found["matches"] is True and found["marker"]["sha256"] == sha and found["size"] == model.stat().st_size
    replacement = tmp_path / "new.gguf"
    replacement.write_bytes(model.read_bytes())  # same bytes, same size: a copy moved over it
    replacement.replace(model)
    assert state.read_file(str(model))["matches"] is False
    assert state.read_file(str(tmp_path / "absent.gguf")) == {"exists": False, "marker": None, "matches": False}


def test_checksums_and_links(tmp_path):
    unit = tmp_path / "llama-a.service"
    unit.write_text("[Unit]\n")
    assert state.checksum(str(unit)) == hashlib.sha1(b"[Unit]\n").hexdigest()
    assert state.checksum(str(tmp_path / "none")) is None
    (tmp_path / "current").symlink_to("0c1e570")
    assert state.read_link(str(tmp_path / "current")) == "0c1e570"
    assert state.read_link(str(unit)) is None


def test_compute_apps_are_read_with_the_process_name_last_and_unknown_memory_as_null():
    text = ("4242, 20610, GPU-0fa0c0de-1111-2222-3333-444455556666, 00000000:00:06.0, "
            "/opt/llama/upstream/current/bin/llama-server\n"
            # a browser's GPU process: its name is a command line full of commas
            "5150, 312, GPU-0fa0c0de-1111-2222-3333-444455556666, 00000000:00:06.0, chrome --type=gpu-process,a=1,b=2\n"
            "6000, [N/A], GPU-0fa0c0de-1111-2222-3333-444455556666, [N/A], [Insufficient Permissions]\n"
            "No running processes found\n")
    first, browser, unknown = state.parse_compute_apps(text, unit={4242: "llama-gemma.service"}.get)
    assert first == {"pid": 4242, "used_mib": 20610, "unit": "llama-gemma.service",
                     "gpu_uuid": "GPU-0fa0c0de-1111-2222-3333-444455556666",
                     "gpu_bus_id": "00000000:00:06.0", "process_name": "/opt/llama/upstream/current/bin/llama-server"}
    assert browser["used_mib"] == 312 and browser["process_name"] == "chrome --type=gpu-process,a=1,b=2"
    assert unknown["used_mib"] is None and unknown["gpu_bus_id"] is None
    assert state.parse_compute_apps("") == [] and browser["unit"] is None


def test_a_process_is_known_by_the_unit_whose_control_group_holds_it(tmp_path):
    # An on-demand router's model server: a child of the router, in its unit's group (cgroup v2, and v1's lines).
    for pid, text in ((10, "0::/system.slice/llama-on-demand.service\n"),
                      (11, "12:pids:/system.slice/llama-a.service\n1:name=systemd:/system.slice/llama-a.service\n"),
                      (12, "0::/user.slice/user-1000.slice/session-2.scope\n")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(text)
    assert state.unit_of(10, str(tmp_path)) == "llama-on-demand.service"
    assert state.unit_of(11, str(tmp_path)) == "llama-a.service"
    assert state.unit_of(12, str(tmp_path)) is None and state.unit_of(13, str(tmp_path)) is None


def test_the_stand_in_answers_the_modules_compute_apps_query(tmp_path, monkeypatch):
    """The lab's stand-in nvidia-smi (a real sh) answers the module's own call, so a test can set a card over plan."""
    from lab import standin_smi

    captures, smi = tmp_path / "captures", tmp_path / "nvidia-smi"
    captures.mkdir()
    smi.write_text(standin_smi.standin_script(str(captures), str(tmp_path / "calls")))
    smi.chmod(0o755)
    monkeypatch.setattr(state, "NVIDIA_SMI", str(smi))

    def run(argv):
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        return done.returncode, done.stdout, done.stderr

    processes, error = state.read_gpu_processes(run)
    assert processes == [] and error.startswith("nvidia-smi exited 9: stand-in nvidia-smi: no captured")
    (captures / standin_smi.COMPUTE_APPS_FILE).write_text(standin_smi.compute_apps_csv([
        {"pid": 4242, "used_memory": 15230, "gpu_uuid": "GPU-aaaa", "gpu_bus_id": "00000000:00:06.0",
         "process_name": "/opt/llama/upstream/current/bin/llama-server"}]))
    processes, error = state.read_gpu_processes(run)
    assert error == "" and [(item["pid"], item["used_mib"], item["gpu_uuid"]) for item in processes] == [
        (4242, 15230, "GPU-aaaa")]
