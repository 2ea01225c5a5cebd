import os

import pytest

from controller.errors import TransportError
from controller.model.fleet import Box
from controller.stages.probe.collect import probe_box
from controller.stages.transports import open_transport

LOCAL = Box(name="here", address="127.0.0.1", transport="local", model_dir="/nonexistent/models")


def test_local_transport_runs_shell_and_reports_exit_codes():
    with open_transport(LOCAL) as transport:
        result = transport.run("echo out; echo err >&2; exit 3")
    assert (result.stdout, result.stderr, result.rc) == ("out\n", "err\n", 3)


def test_local_transport_timeout_is_a_transport_error():
    with pytest.raises(TransportError, match="box here .* did not finish within 1 s"):
        open_transport(LOCAL).run("sleep 5", timeout=1)


def test_probing_this_machine_sees_its_cpu_memory_and_disk():
    profile, raw, seconds = probe_box(LOCAL)
    assert profile.cpu.threads == os.cpu_count()
    assert profile.memory_mib and profile.memory_mib > 512
    assert profile.os.family == "linux" and profile.gpus == []  # no nvidia-smi here
    assert profile.disks and profile.disks[0].path == "/nonexistent/models" and profile.disks[0].free_mib > 0
    assert "cpuinfo" in raw and seconds < 3
