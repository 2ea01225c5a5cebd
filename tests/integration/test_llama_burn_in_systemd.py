"""llama_burn_in on a real systemd box, run by ansible-playbook over SSH with async/poll as a long burn-in is:
a service that systemd restarts during the burn-in and one that keeps running, read through the units' own
counters; the GPUs read from the lab's stand-in nvidia-smi, one card slowing down for heat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from lab import standin_smi

ROOT = Path(__file__).resolve().parents[2]

# Exits every 2 s; systemd starts it again (NRestarts counts those), so any 6 s window sees a restart.
FLAPPING = """[Service]
ExecStart=/bin/sh -c 'sleep 2; exit 1'
Restart=always
RestartSec=1
StartLimitIntervalSec=0
"""
STEADY = "[Service]\nExecStart=/bin/sleep infinity\n"
PLAY = """- hosts: box
  gather_facts: false
  tasks:
    - name: Burn the box in
      v100box.llm.llama_burn_in:
        services:
          - {name: llama-flapping, port: 9, model: tiny}
          - {name: llama-steady, port: 9, model: tiny}
        duration_s: 6
        concurrency: 1
        sample_interval_s: 2
        tolerated_throttle: [sw_power_cap]  # the fleet's own power limit
      async: 60
      poll: 2
      register: burn_in
    - name: Show it
      ansible.builtin.debug: {var: burn_in}
"""


def test_a_restart_during_the_burn_in_is_a_problem(systemd_target, tmp_path):
    for name, unit in (("llama-flapping", FLAPPING), ("llama-steady", STEADY)):
        systemd_target.exec(f"cat > /etc/systemd/system/{name}.service", input=unit)
    systemd_target.exec("systemctl daemon-reload && systemctl start llama-flapping llama-steady")
    standin_smi.install(systemd_target, {})
    standin_smi.set_sample(systemd_target, [
        {"index": 0, "uuid": "GPU-0", "temperature.gpu": 61, "power.draw": 97.3, "power.limit": 100,
         "clocks.sm": 1380, "clocks.mem": 877, "clocks_throttle_reasons.active": "0x0000000000000004"},
        {"index": 1, "uuid": "GPU-1", "temperature.gpu": 89, "power.draw": 71.0, "power.limit": 100,
         "clocks.sm": 705, "clocks.mem": 877, "clocks_throttle_reasons.active": "0x0000000000000048"},
    ])
    boot = systemd_target.exec("cat /proc/sys/kernel/random/boot_id").strip()
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump({"all": {"hosts": {
        "box": systemd_target.ansible_host_vars()}}}))
    (tmp_path / "play.yml").write_text(PLAY)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json"}
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "hosts.yml"),
                           str(tmp_path / "play.yml")], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False, timeout=180)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    result = json.loads(done.stdout)["plays"][0]["tasks"][1]["hosts"]["box"]["burn_in"]
    assert result["changed"] is False and 6 <= result["duration_s"] < 15, result
    flapping, steady = result["restarts"]["llama-flapping"], result["restarts"]["llama-steady"]
    assert flapping["after"] > flapping["before"] and flapping["invocation_changed"] is True, flapping
    assert steady == {"before": 0, "after": 0, "invocation_changed": False}
    assert result["boot_id"] == {"before": boot, "after": boot}
    # samples at 0, 2, 4 and 6 s (maybe not the last); the card at its power limit is tolerated, the hot one not
    samples = len(result["samples"])
    assert result["gpu_sampled"] is True and 3 <= samples <= 4, result["samples"]
    assert result["samples"][0]["gpus"] == [
        {"index": 0, "temp_c": 61, "memory_temp_c": None, "power_w": 97.3, "power_limit_w": 100,
         "sm_clock_mhz": 1380, "mem_clock_mhz": 877, "throttle": ["sw_power_cap"]},
        {"index": 1, "temp_c": 89, "memory_temp_c": None, "power_w": 71, "power_limit_w": 100,
         "sm_clock_mhz": 705, "mem_clock_mhz": 877, "throttle": ["hw_slowdown", "hw_thermal"]}]
    assert f"GPU 1 throttled (hw_slowdown, hw_thermal) in {samples} of {samples} samples; hottest 89 °C." \
        in result["problems"]
    assert not any(problem.startswith("GPU 0") for problem in result["problems"])
    assert (f"Service llama-flapping restarted during the burn-in (NRestarts {flapping['before']} to "
            f"{flapping['after']}).") in result["problems"]
    assert not any("llama-steady restarted" in problem or "llama-steady was" in problem
                   for problem in result["problems"])
    # nothing listens on port 9: every request failed, and the sentence says how
    assert result["requests"]["llama-steady"]["ok"] == 0 and result["requests"]["llama-steady"]["errors"] >= 2
    assert any(problem.startswith("Service llama-steady failed") for problem in result["problems"])
