"""llama_box_state reads what status compares: systemctl's blocks, nvidia-smi's CSV by column name, and a model
file against the record gguf_download wrote after checking it (the two modules' functions, on real files)."""

from __future__ import annotations

import hashlib
import os
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

Id=llama-b.service
LoadState=loaded
ActiveState=failed
SubState=failed
UnitFileState=disabled
FragmentPath=/etc/systemd/system/llama-b.service
DropInPaths=/etc/systemd/system/llama-b.service.d/override.conf /run/systemd/system/llama-b.service.d/x.conf
NeedDaemonReload=yes
"""


def test_systemctl_show_blocks_read_in_the_order_asked():
    units = state.parse_show(SHOW, ["llama-a", "llama-b"])
    assert units["llama-a"] == {"load": "loaded", "active": "active", "sub": "running", "enabled": "enabled",
                                "fragment": "/etc/systemd/system/llama-a.service", "drop_ins": [],
                                "need_reload": False}
    assert units["llama-b"]["active"] == "failed" and units["llama-b"]["need_reload"] is True
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
