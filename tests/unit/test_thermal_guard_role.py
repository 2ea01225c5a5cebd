"""roles/thermal_guard's files, rendered by Ansible's own template engine: the guard's Linux unit (hardened under
`systemd-analyze security --offline=yes`), its configuration as the guard script reads it, the power limits' unit and
configuration, and the Windows side (the WinSW XML running the PowerShell guard, which parses)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.unit.test_thermal_guard import guard
from tests.unit.windows.ansible_local import ROLES, role_vars, run_playbook
from tests.unit.windows.powershell import parse_errors

pytestmark = pytest.mark.slow  # ansible-playbook on localhost: seconds

ROLE = ROLES / "thermal_guard"
THRESHOLD = 2.0  # 1.8 when written; llama_service units are held to the same
VARS = {
    "thermal_guard_enabled": True,
    "thermal_guard_services": ["llama-qwen.service", "llama-gemma.service"],
    "thermal_guard_warn_c": 78,
    "thermal_guard_interval_s": 2,
    "__thermal_guard_power_limits": [{"gpu": 0, "watts": 150, "card": {"min": "100.00", "max": "300.00"}},
                                     {"gpu": 1, "watts": 120, "card": {"min": "100.00", "max": "300.00"}}],
}


def _render(tmp_path: Path, windows: bool, templates: dict[str, str]) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    tasks = [{"name": f"Render {src}", "ansible.builtin.template": {"src": str(ROLE / "templates" / src),
                                                                  "dest": str(out / dest), "mode": "0644"}}
             for src, dest in templates.items()]
    play = {"name": "Render the thermal guard", "hosts": "localhost", "gather_facts": False,
            "vars_files": role_vars("thermal_guard"), "tasks": tasks}
    env_vars = dict(VARS)
    if windows:
        env_vars["thermal_guard_services"] = ["llama-qwen", "llama-gemma"]
    done = run_playbook(tmp_path, [play], extra_vars=env_vars, windows=windows)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def linux(tmp_path_factory) -> Path:
    return _render(tmp_path_factory.mktemp("linux"), False, {
        "thermal-guard.service.j2": "v100box-thermal-guard.service",
        "power-limit.service.j2": "v100box-power-limit.service",
        "thermal-guard.json.j2": "thermal-guard.json",
        "power-limit.json.j2": "power-limit.json",
    })


def _lines(unit: Path, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in unit.read_text().splitlines() if line.startswith(key + "=")]


def test_the_guard_reads_the_configuration_the_role_writes(linux):
    config = guard.Config.load(str(linux / "thermal-guard.json"))
    assert config.services == ("llama-qwen.service", "llama-gemma.service")
    assert (config.warn_c, config.stop_c, config.resume_c, config.interval_s, config.max_restarts) == (78, 85, 75, 2, 3)
    assert config.events == "/var/lib/v100box/thermal-guard/events.jsonl"
    assert config.state == "/var/lib/v100box/thermal-guard/state.json"
    assert json.loads((linux / "power-limit.json").read_text()) == {
        "limits": [{"gpu": 0, "watts": 150}, {"gpu": 1, "watts": 120}]}


def test_the_units_run_the_installed_script_and_order_the_limits_before_the_servers(linux):
    unit, power = linux / "v100box-thermal-guard.service", linux / "v100box-power-limit.service"
    assert shlex.split(_lines(unit, "ExecStart")[0]) == [
        "/usr/bin/python3", "-I", "/usr/local/lib/v100box/thermal_guard.py", "watch", "--config",
        "/etc/v100box/thermal-guard.json"]
    assert _lines(unit, "SyslogIdentifier") == ["v100box-thermal-guard"]
    assert _lines(unit, "StateDirectory") == ["v100box/thermal-guard"]
    assert _lines(power, "Type") == ["oneshot"] and _lines(power, "RemainAfterExit") == ["yes"]
    assert _lines(power, "Before") == ["llama-qwen.service llama-gemma.service"]
    assert "nvidia-persistenced.service" in _lines(power, "After")[0]
    assert shlex.split(_lines(power, "ExecStart")[0])[3:] == [
        "power-limit", "--config", "/etc/v100box/power-limit.json", "--state", "/var/lib/v100box/power-limit.json",
        "--nvidia-smi", "/usr/bin/nvidia-smi"]
    assert _lines(power, "WantedBy") == ["multi-user.target"]


def test_the_root_units_never_look_a_tool_up_in_usr_local(linux):
    """Both units run as root: an nvidia-smi or systemctl dropped in /usr/local/bin must never run."""
    config = guard.Config.load(str(linux / "thermal-guard.json"))
    assert (config.nvidia_smi, config.systemctl) == ("/usr/bin/nvidia-smi", "/usr/bin/systemctl")
    for unit in ("v100box-thermal-guard.service", "v100box-power-limit.service"):
        assert _lines(linux / unit, "Environment") == ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], unit


def test_the_guard_unit_is_hardened(linux):
    found = shutil.which("systemd-analyze")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is missing (Debian 12's systemd package has it)")
        pytest.skip("systemd-analyze is not installed here")
    unit = linux / "v100box-thermal-guard.service"
    done = subprocess.run([found, "security", "--offline=yes", "--no-pager", str(unit)], capture_output=True,
                          text=True, check=False)
    score = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout + done.stderr)
    assert score, done.stdout[-2000:] + done.stderr
    assert float(score.group(1)) < THRESHOLD, done.stdout
    assert _lines(unit, "CapabilityBoundingSet") == [""] and _lines(unit, "RestrictAddressFamilies") == ["AF_UNIX"]


def test_the_windows_guard_runs_the_powershell_script_under_winsw(tmp_path):
    out = _render(tmp_path, True, {"thermal-guard-winsw.xml.j2": "guard.xml", "thermal-guard.json.j2": "guard.json"})
    service = ET.parse(out / "guard.xml").getroot()
    assert service.findtext("id") == "v100box-thermal-guard"
    assert service.findtext("executable").endswith(r"\powershell.exe")
    arguments = service.findtext("arguments")
    assert r"-File C:\llama\services\v100box-thermal-guard\thermal-guard.ps1" in arguments
    assert r"-Config C:\llama\services\v100box-thermal-guard\thermal-guard.json" in arguments
    assert service.find("depend") is None and service.find("serviceaccount") is None  # LocalSystem
    config = json.loads((out / "guard.json").read_text())
    assert config["services"] == ["llama-qwen", "llama-gemma"]
    assert config["events"] == r"C:\ProgramData\v100box\thermal-guard\events.jsonl"


def test_the_powershell_guard_parses_and_follows_the_same_contract():
    script = (ROLE / "files" / "thermal-guard.ps1").read_text()
    assert parse_errors(script) == []
    assert script.isascii()  # Windows PowerShell 5.1 reads a file without a BOM in the ANSI code page
    assert guard.SAMPLE_QUERY in script
    for field in ("time", "kind", "gpu", "temp_c", "memory_temp_c", "service", "message"):
        assert re.search(rf"^\s+{field} = ", script, re.MULTILINE), field
    assert "Stop-Service" in script and "Start-Service" in script and "Stop-Process" not in script
