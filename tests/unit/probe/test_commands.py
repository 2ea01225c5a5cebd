"""The probe commands run for real in sh on this machine: quiet without nvidia-smi, parseable with one."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from controller.stages.probe import (
    LINUX_PROBE_COMMANDS,
    PROBE_FILES,
    group_names,
    linux_probe_commands,
    linux_probe_script,
    parse_outputs,
    shell_path,
    split_probe_output,
)
from tests.unit.probe.helpers import WRITTEN

BARE_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def _run_script(model_dir: str, path: str = BARE_PATH, extra_env: dict[str, str] | None = None) -> tuple[str, int]:
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/root"), **(extra_env or {})}
    done = subprocess.run(["sh", "-c", linux_probe_script(model_dir)], capture_output=True, text=True, env=env,
                          timeout=60, check=False)
    return done.stdout, done.returncode


def test_every_contract_file_has_a_command() -> None:
    assert set(LINUX_PROBE_COMMANDS) == set(PROBE_FILES) - {"windows-cim.json"}
    assert "{model_dir}" in LINUX_PROBE_COMMANDS["df.txt"]


def test_script_on_a_box_without_nvidia_smi_is_quiet_and_parses(tmp_path: Path) -> None:
    assert subprocess.run(["sh", "-c", "command -v nvidia-smi"], env={"PATH": BARE_PATH},
                          capture_output=True, check=False).returncode != 0, "this test needs a box without nvidia-smi"
    model_dir = tmp_path / "not yet" / "it's" / "models"  # missing, with a space and a quote
    started = time.monotonic()
    stdout, status = _run_script(str(model_dir))
    elapsed = time.monotonic() - started
    assert status == 0
    outputs = split_probe_output(stdout)
    assert set(outputs) == set(LINUX_PROBE_COMMANDS)
    for name in ("nvidia-smi-query.csv", "nvidia-smi.txt", "nvidia-smi-topo.txt", "nvidia-smi-nvlink.txt"):
        assert outputs[name] == "", name
    assert outputs["cpuinfo"] == Path("/proc/cpuinfo").read_text()  # outputs come back byte for byte
    profile = parse_outputs(outputs, model_dir=str(model_dir))
    assert profile.warnings == []
    assert profile.gpus == [] and group_names(profile)[-1] == "cpu_only"
    assert profile.cpu.threads == os.cpu_count()
    assert profile.memory_mib and profile.memory_mib > 0
    assert profile.os.family == "linux"
    assert profile.disks[0].path == str(model_dir)  # df walked up to tmp_path's filesystem
    assert profile.disks[0].free_mib is not None
    assert elapsed < 3.0, f"the probe script took {elapsed:.2f} s locally"


def _stand_in_nvidia_smi(folder: Path, machine: str) -> Path:
    """A fake nvidia-smi that prints a fixture and, like drivers before R510, rejects compute_cap."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    fixtures = WRITTEN / machine
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{folder}/calls.log"\n'
        'case "$*" in\n'
        '  *compute_cap*) echo \'Field "compute_cap" is not a valid field to query.\'; exit 2 ;;\n'
        f'  --query-gpu=*) cat "{fixtures}/nvidia-smi-query.csv" ;;\n'
        f'  "topo -m") cat "{fixtures}/nvidia-smi-topo.txt" ;;\n'
        f'  "nvlink -s") cat "{fixtures}/nvidia-smi-nvlink.txt" ;;\n'
        f'  "") cat "{fixtures}/nvidia-smi.txt" ;;\n'
        "  *) exit 9 ;;\n"
        "esac\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def test_script_with_an_old_driver_falls_back_to_the_query_without_compute_cap(tmp_path: Path) -> None:
    bin_dir = _stand_in_nvidia_smi(tmp_path, "twelve-v100-threadripper")
    stdout, status = _run_script("/", path=f"{bin_dir}:{BARE_PATH}")
    assert status == 0
    calls = (tmp_path / "calls.log").read_text().splitlines()
    queries = [call for call in calls if call.startswith("--query-gpu=")]
    assert len(queries) == 2 and "compute_cap" in queries[0] and "compute_cap" not in queries[1]
    outputs = split_probe_output(stdout)
    assert "not a valid field" not in outputs["nvidia-smi-query.csv"]
    profile = parse_outputs(outputs)
    assert len(profile.gpus) == 12
    assert profile.boards == [[0, 1], [2, 3], [4, 5, 8, 9], [6, 7, 10, 11]]
    assert profile.warnings == []


def test_split_keeps_outputs_without_a_final_newline() -> None:
    stdout = subprocess.run(
        ["sh", "-c", ("printf '\\n%s\\n' '==> v100-llm-box probe output: nproc'; printf 8; "
                      "printf '\\n%s\\n' '==> v100-llm-box probe output: meminfo'; printf 'MemTotal: 2048 kB\\n'")],
        capture_output=True, text=True, check=True).stdout
    assert split_probe_output(stdout) == {"nproc": "8", "meminfo": "MemTotal: 2048 kB\n"}


@pytest.mark.parametrize(
    ("path", "quoted"),
    [("/var/lib/llama/models", "/var/lib/llama/models"), ("~/models", '"$HOME"/models'), ("~", '"$HOME"'),
     ("/srv/my models", "'/srv/my models'"), ("/x/$(reboot)", "'/x/$(reboot)'")],
)
def test_model_dir_is_quoted_for_sh(path: str, quoted: str) -> None:
    assert shell_path(path) == quoted
    assert f"d={quoted};" in linux_probe_commands(path)["df.txt"]
