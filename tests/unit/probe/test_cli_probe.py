"""``controller probe``: the --from-dir contract, exit codes, and the live path ending in the same output."""

from __future__ import annotations

import json
import shutil
import socket
import sys
import threading
import types
from pathlib import Path

from controller.stages.probe import parse_outputs
from tests.cli import invoke, run_controller
from tests.unit.clean_errors import assert_one_line_error
from tests.unit.probe.helpers import WRITTEN, machine

CONTRACT_GPU_KEYS = {"index", "uuid", "name", "memory_mib", "compute_capability", "pci_bus_id", "serial"}


def _invoke(*args: str):
    return invoke("probe", *args)


def test_from_dir_json_has_the_contract_fields() -> None:
    result = _invoke("--from-dir", str(WRITTEN / "twelve-v100-threadripper"), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert CONTRACT_GPU_KEYS <= set(data["gpus"][0])
    assert data["gpus"][0]["compute_capability"] == "7.0"
    assert data["driver"] == {"version": "580.95.05", "cuda_version": "13.0", "model": None}
    assert [0, 1, 6] in data["nvlink"]["pairs"]
    assert data["boards"] == [[0, 1], [2, 3], [4, 5, 8, 9], [6, 7, 10, 11]]
    assert data["cpu"]["cores"] == 32 and data["cpu"]["avx2"] is True and data["cpu"]["avx512"] is False
    assert data["memory_mib"] == 257594
    assert data["os"] == {"family": "linux", "name": "Ubuntu", "version": "22.04", "wsl": False}
    assert data["warnings"] == []


def test_from_dir_summary_for_a_person() -> None:
    result = _invoke("--from-dir", str(WRITTEN / "dual-v100-nvlink-windows-tcc"))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Tesla V100-SXM2-16GB" in out
    assert "driver: 573.96 (CUDA 12.8, TCC)" in out
    assert "NVLink: 0-1 NV2" in out
    assert "boards: 0:{0,1} (a fleet pins a model to one with board: N)" in out
    assert "groups: windows, dual_nvlink" in out


def test_summary_shows_warnings() -> None:
    result = _invoke("--from-dir", str(WRITTEN / "cut-short-table"))
    assert result.exit_code == 0
    assert "warning: nvidia-smi.txt line 15: the table ends before GPU 1's usage line" in result.stdout


def test_nothing_usable_exits_2_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "nvidia-smi.txt").write_bytes(bytes(range(256)) * 20)
    result = _invoke("--from-dir", str(tmp_path), "--json")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"error: nothing usable was parsed from {tmp_path}")
    assert "nvidia-smi.txt: is not text" in result.stderr


def test_the_topology_matrix_alone_gives_the_links_and_boards(tmp_path: Path) -> None:
    shutil.copy(WRITTEN / "twelve-v100-threadripper" / "nvidia-smi-topo.txt", tmp_path)
    result = _invoke("--from-dir", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    profile = json.loads(result.stdout)
    assert profile["gpus"] == []
    assert [0, 1, 6] in profile["nvlink"]["pairs"] and [6, 11, 2] in profile["nvlink"]["pairs"]
    assert profile["boards"] == [[0, 1], [2, 3], [4, 5, 8, 9], [6, 7, 10, 11]]
    text = _invoke("--from-dir", str(tmp_path))
    assert text.exit_code == 0 and "boards: 0:{0,1} 1:{2,3} 2:{4,5,8,9} 3:{6,7,10,11}" in text.stdout


def test_empty_or_missing_dir_exits_2(tmp_path: Path) -> None:
    empty = _invoke("--from-dir", str(tmp_path))
    assert empty.exit_code == 2 and "none of the probe files is there" in empty.stderr
    missing = _invoke("--from-dir", str(tmp_path / "nope"))
    assert missing.exit_code == 2 and "not a folder" in missing.stderr


def test_box_or_from_dir_not_both_and_box_needs_a_fleet(tmp_path: Path) -> None:
    both = _invoke("box3", "--from-dir", str(tmp_path))
    assert both.exit_code == 2 and "either BOX" in both.output
    no_fleet = _invoke("box3")
    assert no_fleet.exit_code == 2 and "add --fleet FILE" in no_fleet.stderr


def test_live_probe_path_prints_the_same_as_from_dir(tmp_path: Path, monkeypatch) -> None:
    fleet = tmp_path / "fleet.yml"
    fleet.write_text("boxes:\n  box3:\n    address: 192.0.2.10\n")
    seen = []

    def probe_box(box, *, known_hosts=None):  # the transport boundary: what the lead's collect module returns
        seen.append(box.name)
        outputs = machine("single-v100-16g-linux")
        return parse_outputs(outputs), outputs, 0.2

    monkeypatch.setitem(sys.modules, "controller.stages.probe.collect",
                        types.SimpleNamespace(probe_box=probe_box))
    folder = tmp_path / "captured"
    shutil.copytree(WRITTEN / "single-v100-16g-linux", folder)
    live = _invoke("box3", "--fleet", str(fleet), "--json")
    offline = _invoke("--from-dir", str(folder), "--json")
    assert seen == ["box3"]
    assert live.exit_code == offline.exit_code == 0
    assert live.stdout == offline.stdout


def test_unknown_box_is_a_fleet_error(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yml"
    fleet.write_text("boxes:\n  box3:\n    address: 192.0.2.10\n")
    result = _invoke("box9", "--fleet", str(fleet))
    assert result.exit_code == 2
    assert "no box named 'box9' (boxes: box3)" in result.stderr


def test_a_short_junk_cpuinfo_is_not_evidence_of_linux(tmp_path: Path) -> None:
    (tmp_path / "cpuinfo").write_bytes(b"\x00\x01\x02garbage\xff\n")
    result = _invoke("--from-dir", str(tmp_path))
    assert result.exit_code == 2
    assert "cpuinfo: no 'processor' entries found" in result.stderr


def test_a_web_server_on_the_ssh_port_is_one_line_without_paramikos_traceback(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def answer_like_a_web_server() -> None:
            while True:
                try:
                    client, _ = listener.accept()
                except OSError:
                    return
                with client:
                    client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

        threading.Thread(target=answer_like_a_web_server, daemon=True).start()
        fleet = tmp_path / "fleet.yml"
        fleet.write_text(f"boxes:\n  box3:\n    address: 127.0.0.1\n    port: {listener.getsockname()[1]}\n")
        result = run_controller("probe", "box3", "--fleet", str(fleet), timeout=60)
    assert_one_line_error(result, 3, "box box3", "Error reading SSH protocol banner", "check the address")


def test_probed_text_with_square_brackets_prints_as_written(tmp_path: Path) -> None:
    folder = tmp_path / "captured"
    shutil.copytree(WRITTEN / "single-v100-16g-linux", folder)
    cpuinfo = folder / "cpuinfo"
    cpuinfo.write_text(cpuinfo.read_text().replace("AMD Ryzen 5 5600X", "AMD [/] Ryzen [bold]5[/bold]"))
    result = run_controller("probe", "--from-dir", str(folder), timeout=60)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "CPU: AMD [/] Ryzen [bold]5[/bold] 6-Core Processor" in result.stdout
