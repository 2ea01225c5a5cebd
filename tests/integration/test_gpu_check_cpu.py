"""``python -m lab.gpu_check --cpu`` end to end on the CPU engine: two recorded-truth cases, the product's nvidia-smi
queries (answered by a stand-in that replays the recorded driver-580 answers), the CPU server traced under strace and
checked against the rendered unit, one folder and one archive, and nothing left running."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT.parent / "shared" / "fixtures" / "gpu-h100-580"
CASES = ("gemma3-swa96-p3-hd128-c30000-np3-split", "gpu-qwen3moe-c32768-np4-split-q4_0")


def _recorded(path: Path) -> str:
    lines = path.read_text().splitlines()
    while lines and lines[-1].startswith("rc="):
        lines.pop()
    return "\n".join(lines) + "\n"


def _standin_smi(folder: Path) -> Path:
    """An nvidia-smi that answers the product's queries with the recorded H100 answers."""
    answers = folder / "answers"
    answers.mkdir()
    for name in ("guard-sample.csv", "guard-power.csv", "box-state.csv"):
        (answers / name).write_text(_recorded(RECORDED / "nvidia-smi" / name))
    for name in ("nvidia-smi-query.csv", "nvidia-smi.txt", "nvidia-smi-topo.txt", "nvidia-smi-nvlink.txt"):
        (answers / name).write_text((RECORDED / "probe" / name).read_text())
    (answers / "smi-q.txt").write_text((RECORDED / "nvidia-smi" / "smi-q.txt").read_text())
    # not recorded: the nvidia_driver role's list, made from the recorded card
    (answers / "driver-gpus.csv").write_text("0, 00000000:00:06.0, NVIDIA H100 80GB HBM3, 580.159.04\n")
    script = folder / "nvidia-smi"
    script.write_text(f"""#!/bin/sh
a={answers}
case "$*" in
  *index,uuid,temperature.gpu*) cat $a/guard-sample.csv ;;
  *power.min_limit*) cat $a/guard-power.csv ;;
  *index,name,driver_version,temperature.gpu*) cat $a/box-state.csv ;;
  *index,pci.bus_id,name,driver_version*) cat $a/driver-gpus.csv ;;
  --query-gpu=*) cat $a/nvidia-smi-query.csv ;;
  '') cat $a/nvidia-smi.txt ;;
  '-q') cat $a/smi-q.txt ;;
  'topo -m') cat $a/nvidia-smi-topo.txt ;;
  'nvlink -s') cat $a/nvidia-smi-nvlink.txt ;;
  *) echo "stand-in: no answer for $*" >&2; exit 9 ;;
esac
""")
    script.chmod(0o755)
    return script


def _left_running() -> list[str]:
    """Processes still working in a check's work folder (servers and strace run there)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and "gpu-check-work-" in os.readlink(entry / "cwd"):
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return found


def test_the_cpu_check_records_cases_reads_nvidia_smi_and_checks_the_trace(llama_server, tmp_path):
    if shutil.which("strace") is None:
        pytest.fail("strace is not installed; run ./scripts/bootstrap.sh")
    out = tmp_path / "gpu-check"
    command = [sys.executable, "-m", "lab.gpu_check", "--cpu", "--out", str(out), "--cases", ",".join(CASES),
               "--server", str(llama_server)]
    if RECORDED.is_dir():
        command += ["--nvidia-smi", str(_standin_smi(tmp_path))]
    elif os.environ.get("CI") == "true":
        pytest.fail(f"{RECORDED} is missing; CI runs with shared/ beside the clone")
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert took < 60, f"the CPU check took {took:.0f} s"
    summary = json.loads((out / "summary.json").read_text())
    sections = {s["name"]: s for s in summary["sections"]}
    assert summary["passed"] and sections["cases"]["status"] == "pass" and sections["trace"]["status"] == "pass"
    assert "gpu check: PASS" in done.stdout

    for name in CASES:
        record = json.loads((out / "cpu-truth" / f"{name}.json").read_text())
        assert record["error"] is None and record["truth"]["model_buffers"]["CPU"] > 0
        assert record["truth"]["server_cmd"][:3] == ["llama-server", "-m", f"models/{record['truth']['server_cmd'][2][7:]}"]
        assert "llama_kv_cache" in (out / "cpu-truth" / f"{name}.log").read_text()
        if RECORDED.is_dir():  # the cache is the same size on the CPU as on the H100
            cuda = json.loads((RECORDED / "cuda-truth" / f"{name}.json").read_text())
            assert record["truth"]["kv_mib"] == cuda["truth"]["kv_mib"]
            assert record["truth"]["kv_caches"] == cuda["truth"]["kv_caches"]

    syscalls = (out / "cpu-syscalls.txt").read_text().split()
    assert {"openat", "mmap", "socket", "accept4"} <= set(syscalls)
    checks = {c["name"]: c for c in json.loads((out / "trace-checks.json").read_text())["checks"]}
    assert checks["system calls"]["status"] == "pass" and checks["socket families"]["status"] == "pass"
    assert "AF_INET" in json.loads((out / "trace-checks.json").read_text())["socket_families"]
    assert "DevicePolicy=closed" in (out / "unit" / "llama.service").read_text()

    if RECORDED.is_dir():
        assert sections["nvidia-smi"]["status"] == "pass", sections["nvidia-smi"]
        assert (out / "probe" / "nvidia-smi-q.txt").read_text().startswith("\n==============NVSMI LOG")
        assert "/dev/nvidia0 rw" in (out / "unit" / "llama.service").read_text()  # rendered for the probed card

    with tarfile.open(out.parent / "gpu-check.tar.xz") as archive:
        names = archive.getnames()
    assert "gpu-check/summary.txt" in names and f"gpu-check/cpu-truth/{CASES[0]}.json" in names
    assert _left_running() == []
