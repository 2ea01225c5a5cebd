"""llama_burn_in against the real CPU llama-server, run as Ansible runs a module: a few seconds of streaming load
on both APIs with a stand-in nvidia-smi, named to the module, whose rows a test writes (a cool card, then a card throttling for
heat), and a service whose port is dead."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.target import free_port
from tests.unit.plugins import loader

pytestmark = pytest.mark.engine

KEY = "burn-in-key-0123456789abcdef"
QUERY = ("--query-gpu=index,uuid,temperature.gpu,temperature.memory,power.draw,power.limit,clocks.sm,clocks.mem,"
         "clocks_throttle_reasons.active --format=csv,noheader,nounits")
COOL = "0, GPU-1b7e7b3c-7d4e-4d2c-9d0e-000000000000, 61, 66, 97.30, 100.00, 1380, 877, 0x0000000000000000\n"
IDLE = "1, GPU-2c8f8c4d-8e5f-5e3d-ae1f-111111111111, 35, [N/A], 24.10, 100.00, 135, 877, 0x0000000000000001\n"
HOT = "0, GPU-1b7e7b3c-7d4e-4d2c-9d0e-000000000000, 86, 91, 97.30, 100.00, 1005, 877, 0x0000000000000020\n"


def standin_smi(folder: Path, rows: str) -> Path:
    """An nvidia-smi that answers only the burn-in's sample query, with ``rows``; returns its folder."""
    folder.mkdir(exist_ok=True)
    (folder / "rows.csv").write_text(rows)
    smi = folder / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\n[ "$*" = "{QUERY}" ] || {{ echo "unexpected: $*" >&2; exit 9; }}\n'
                   f'cat {folder / "rows.csv"}\n')
    smi.chmod(0o755)
    return folder


def run_module(tmp_path: Path, smi_dir: Path, **args) -> tuple[dict, str]:
    """The module as Ansible runs it, told where the stand-in is (it never looks nvidia-smi up on PATH)."""
    done, result = loader.run_module("llama_burn_in", tmp_path, {**args, "nvidia_smi": str(smi_dir / "nvidia-smi")})
    return result, done.stdout


@pytest.fixture(scope="module")
def server(llama_server, tmp_path_factory):
    with loader.tiny_server(llama_server, tmp_path_factory.mktemp("m"), KEY, "-c", "2048", "-np", "2") as running:
        yield running


def test_a_healthy_burn_in_has_speeds_samples_and_no_problem(server, tmp_path):
    key_file = tmp_path / "tiny.key"
    key_file.write_text(KEY + "\n")
    smi = standin_smi(tmp_path / "smi", COOL + IDLE)
    result, raw = run_module(tmp_path, smi, duration_s=8, concurrency=2, max_tokens=32, sample_interval_s=2,
                             services=[{"name": "llama-tiny", "port": server.port, "model": "tiny",
                                        "api_key_file": str(key_file)}])
    assert not result.get("failed") and result["changed"] is False, result
    assert result["problems"] == [], result["problems"]
    counts = result["requests"]["llama-tiny"]
    assert counts["errors"] == 0 and counts["ok"] > 4, counts
    series = result["series"]["llama-tiny"]
    assert series and all(point["tok_s"] > 0 for point in series)
    assert [point["t"] for point in series] == sorted(point["t"] for point in series)
    assert 8 <= result["duration_s"] < 20
    # a sample at the start and every 2 s; the idle card is not throttling
    assert result["gpu_sampled"] is True and 4 <= len(result["samples"]) <= 6
    assert result["samples"][0]["gpus"] == [
        {"index": 0, "temp_c": 61, "memory_temp_c": 66, "power_w": 97.3, "power_limit_w": 100, "sm_clock_mhz": 1380,
         "mem_clock_mhz": 877, "throttle": []},
        {"index": 1, "temp_c": 35, "memory_temp_c": None, "power_w": 24.1, "power_limit_w": 100, "sm_clock_mhz": 135,
         "mem_clock_mhz": 877, "throttle": []}]
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert result["boot_id"] == {"before": boot, "after": boot}
    assert set(result["restarts"]) == {"llama-tiny"}
    assert KEY not in raw


def test_heat_throttling_and_a_dead_service_are_problems(server, tmp_path):
    smi = standin_smi(tmp_path / "smi", HOT)
    dead = free_port()
    result, raw = run_module(tmp_path, smi, duration_s=3, concurrency=1, max_tokens=16, sample_interval_s=1,
                             services=[{"name": "llama-tiny", "base_url": server.url, "model": "tiny",
                                        "api_key": KEY},
                                       {"name": "llama-gone", "port": dead, "model": "tiny"}])
    assert not result.get("failed"), result
    assert result["requests"]["llama-tiny"]["errors"] == 0 and result["series"]["llama-tiny"]
    gone = result["requests"]["llama-gone"]
    assert gone["ok"] == 0 and gone["errors"] >= 2 and "/v1/chat/completions:" in gone["messages"][0]
    assert result["series"]["llama-gone"] == []
    samples = len(result["samples"])
    assert samples >= 3 and all(s["gpus"][0]["throttle"] == ["sw_thermal"] for s in result["samples"])
    assert result["problems"][0] == f"GPU 0 throttled (sw_thermal) in {samples} of {samples} samples; hottest 86 °C " \
                                    f"(memory 91 °C)."
    assert result["problems"][1].startswith(f"Service llama-gone failed {gone['errors']} of {gone['errors']} "
                                            f"requests (first: /v1/chat/completions: ")
    assert len(result["problems"]) == 2 and KEY not in raw
