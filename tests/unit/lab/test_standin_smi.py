"""The stand-in nvidia-smi answers the thermal guard's and the power limits' forms, run here by a real sh."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from lab import standin_smi


class LocalBox:
    """Runs the stand-in's commands on this machine, its folders moved under a temporary one."""

    def __init__(self, root: Path):
        self.root = root
        self.captures = root / "captures"
        self.log = root / "calls"

    def exec(self, command: str, *, input: str | None = None, timeout: float = 300) -> str:
        command = command.replace(standin_smi.CAPTURE_DIR, str(self.captures))
        command = command.replace(standin_smi.CALL_LOG, str(self.log))
        command = command.replace(standin_smi.STANDIN_PATH, str(self.root / "nvidia-smi"))
        done = subprocess.run(["sh", "-c", command], input=input, capture_output=True, text=True, timeout=timeout,
                              check=True)
        return done.stdout

    def smi(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.root / "nvidia-smi"), *args], capture_output=True, text=True, check=False)


@pytest.fixture
def box(tmp_path: Path) -> LocalBox:
    local = LocalBox(tmp_path)
    (tmp_path / "nvidia-smi").write_text(standin_smi.standin_script(str(local.captures), str(local.log)))
    (tmp_path / "nvidia-smi").chmod(0o755)
    local.exec(f"mkdir -p {local.captures} && : > {local.log}")
    return local


def test_sample_prints_the_rows_a_test_set_with_missing_fields_as_not_available(box):
    standin_smi.set_sample(box, [
        {"index": 0, "uuid": "GPU-aaaa", "temperature.gpu": 86, "temperature.memory": 79, "power.draw": 250.5,
         "power.limit": 300, "clocks.sm": 1530, "clocks.mem": 877, "clocks_throttle_reasons.active": "0x0000000000000000"},
        {"index": 1, "temperature.gpu": 41},
    ])
    done = box.smi(f"--query-gpu={standin_smi.SAMPLE_QUERY}", "--format=csv,noheader,nounits")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "0, GPU-aaaa, 86, 79, 250.5, 300, 1530, 877, 0x0000000000000000",
        "1, [N/A], 41, [N/A], [N/A], [N/A], [N/A], [N/A], [N/A]",
    ]
    standin_smi.set_sample(box, [{"index": 0, "temperature.gpu": 70}])  # rewritten, not appended
    assert box.smi(f"--query-gpu={standin_smi.SAMPLE_QUERY}", "--format=csv,noheader,nounits").stdout.startswith("0, [N/A], 70,")


def test_power_range_and_the_setting_forms_succeed_and_are_logged(box):
    standin_smi.set_power_range(box, [{"index": 0, "power.min_limit": 100, "power.max_limit": 300,
                                       "power.default_limit": 250}])
    done = box.smi(f"--query-gpu={standin_smi.POWER_QUERY}", "--format=csv,noheader,nounits")
    assert (done.returncode, done.stdout) == (0, "0, 100, 300, 250\n")
    assert box.smi("-pm", "1").returncode == 0
    limit = box.smi("-i", "0", "-pl", "150")
    assert limit.returncode == 0 and "150 W" in limit.stdout
    assert box.log.read_text().splitlines() == [
        f"--query-gpu={standin_smi.POWER_QUERY} --format=csv,noheader,nounits", "-pm 1", "-i 0 -pl 150"]


def test_a_form_without_its_file_fails_like_a_broken_tool(box):
    done = box.smi(f"--query-gpu={standin_smi.SAMPLE_QUERY}", "--format=csv,noheader,nounits")
    assert done.returncode == 9 and "no captured nvidia-smi-sample.csv" in done.stderr
    other = box.smi("-i", "0", "-pl", "abc")
    assert other.returncode == 9


def test_the_probe_query_is_still_answered_from_its_capture(box):
    (box.captures / "nvidia-smi-query.csv").write_text("index, name\n0, Tesla V100-SXM2-32GB\n")
    done = box.smi("--query-gpu=index,name", "--format=csv")
    assert (done.returncode, done.stdout) == (0, "index, name\n0, Tesla V100-SXM2-32GB\n")


def test_unknown_fields_and_files_are_refused(box):
    with pytest.raises(ValueError, match="not fields of"):
        standin_smi.sample_csv([{"index": 0, "temperature": 80}])
    with pytest.raises(ValueError, match="not nvidia-smi captures"):
        standin_smi.install(box, {"nvidia-smi-temps.csv": ""})


def test_q_prints_its_capture_and_fails_without_one(box):
    """The probe's nvidia-smi -q (issue 20: each card's device minor number)."""
    assert box.smi("-q").returncode == 9  # nothing captured: a broken tool, which the probe ignores
    box.exec(f"cat > {standin_smi.CAPTURE_DIR}/nvidia-smi-q.txt", input="GPU 00000000:04:00.0\n")
    done = box.smi("-q")
    assert done.returncode == 0 and done.stdout == "GPU 00000000:04:00.0\n"


def test_compute_apps_prints_the_processes_a_test_set_and_nothing_when_none_holds_a_card(box):
    """Issue 20 item 5: certify compares what each server's process holds on each card with the plan."""
    query = (f"--query-compute-apps={standin_smi.COMPUTE_APPS_QUERY}", "--format=csv,noheader,nounits")
    assert box.smi(*query).returncode == 9  # nothing set: a broken tool
    standin_smi.set_compute_apps(box, [
        {"pid": 4242, "used_memory": 20610, "gpu_uuid": "GPU-aaaa", "gpu_bus_id": "00000000:00:06.0",
         "process_name": "/opt/llama/upstream/current/bin/llama-server"},
        {"pid": 7, "gpu_uuid": "GPU-bbbb"}])
    done = box.smi(*query)
    assert done.returncode == 0 and done.stdout.splitlines() == [
        "4242, 20610, GPU-aaaa, 00000000:00:06.0, /opt/llama/upstream/current/bin/llama-server",
        "7, [N/A], GPU-bbbb, [N/A], [N/A]"]
    standin_smi.set_compute_apps(box, [])  # no process on any card: nvidia-smi prints nothing
    assert (box.smi(*query).returncode, box.smi(*query).stdout) == (0, "")
    with pytest.raises(ValueError, match="not fields of"):
        standin_smi.compute_apps_csv([{"pid": 1, "used_gpu_memory": 5}])
