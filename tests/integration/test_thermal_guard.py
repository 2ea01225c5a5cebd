"""The thermal guard and the power limits on a real provisioned box (SSH into a systemd container, the CPU engine, a
tiny model) with a stand-in nvidia-smi whose temperatures the test sets: a warning at 81 °C, the llama service
stopped through systemd at 86 °C and started again at 70 °C, the restart limit, a failing nvidia-smi logged once,
the events in the JSON lines file and the journal; the power limit applied at boot by its oneshot unit and
recorded, a limit outside the card's range refused with the range before anything changes, and thresholds out of
order refused by the fleet file in one line."""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import pytest
import yaml

from lab import standin_smi
from lab.target import free_port
from tests.cli import run_controller

pytestmark = [pytest.mark.podman, pytest.mark.engine, pytest.mark.slow]

controller = partial(run_controller, timeout=600)
SERVICE = "llama-tiny-llama.service"
GUARD = "v100box-thermal-guard.service"
EVENTS = "/var/lib/v100box/thermal-guard/events.jsonl"
POWER_STATE = "/var/lib/v100box/power-limit.json"
POWER_CONFIG = "/etc/v100box/power-limit.json"
# What a V100 PCIe reports: the power range the preflight checks limits against.
POWER_RANGE = [{"index": 0, "power.min_limit": "100.00", "power.max_limit": "300.00", "power.default_limit": "250.00"}]


def reading(temp: float, memory: float | None = None) -> list[dict]:
    return [{"index": 0, "uuid": "GPU-5a7b9f1e-0000-4000-8000-000000000000", "temperature.gpu": temp,
             "temperature.memory": memory, "power.draw": 120.5, "power.limit": 150.0, "clocks.sm": 1380,
             "clocks.mem": 877, "clocks_throttle_reasons.active": "0x0000000000000000"}]


def write_fleet(path: Path, box: dict, **changes) -> Path:
    fleet = yaml.safe_load(path.read_text()) if path.exists() else {}
    fleet = {**fleet, "boxes": {"lab1": {**box, **changes}}} if box else fleet
    path.write_text(yaml.safe_dump(fleet))
    return path


@pytest.fixture(scope="module")
def box(tmp_path_factory, site_server, systemd_target):
    server, catalog = site_server
    folder = tmp_path_factory.mktemp("thermal")
    # Only the guard's and the power limits' forms answer: the probe's own nvidia-smi queries fail quietly, so the
    # box is still planned on the CPU engine, while the role and the guard read their stand-in readings.
    standin_smi.install(systemd_target, {})
    standin_smi.set_sample(systemd_target, reading(40, 38))
    standin_smi.set_power_range(systemd_target, POWER_RANGE)
    body = {"address": systemd_target.host, "port": systemd_target.ssh_port, "user": "root",
            "key": str(systemd_target.key), "models": [{"id": "tiny-llama", "ctx": 2048}],
            "mirror": {"engines": f"{server.url}/engines", "models": server.url}, "base_port": free_port(),
            "thermal": {"guard": True, "interval_s": 1, "max_restarts": 1}, "power_limit_w": 150}
    fleet = folder / "fleet.yml"
    fleet.write_text(yaml.safe_dump({"catalogs": [str(catalog)], "boxes": {"lab1": body}}))
    done = controller("provision", "lab1", "--fleet", str(fleet), "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    yield {"fleet": fleet, "body": body, "target": systemd_target}
    standin_smi.uninstall(systemd_target)


def events(target) -> list[dict]:
    text = target.run(f"cat {EVENTS}").stdout
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def wait_for(target, predicate, what: str, timeout: float = 20) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = events(target)
        if predicate(found):
            return found
        if time.monotonic() > deadline:
            journal = target.run("journalctl -u v100box-thermal-guard --no-pager -n 30").stdout
            raise AssertionError(f"no {what} within {timeout} s; events: {found}; journal: {journal}")
        time.sleep(0.5)


def is_active(target, unit: str) -> str:
    return target.run(f"systemctl is-active {unit}").stdout.strip()


def healthy(target, port: int, timeout: float = 60) -> bool:
    probe = (f"python3 -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health', "
             f"timeout=2)\"")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if target.run(probe).returncode == 0:
            return True
        time.sleep(1)
    return False


def test_the_power_limit_is_applied_by_its_boot_unit_and_recorded(box):
    target = box["target"]
    assert is_active(target, "v100box-power-limit.service") == "active"
    assert target.run("systemctl is-enabled v100box-power-limit.service").stdout.strip() == "enabled"
    assert json.loads(target.exec(f"cat {POWER_STATE}")) == {
        "persistence": True, "limits": [{"gpu": 0, "watts": 150, "applied": True, "range": [100.0, 300.0]}]}
    # The unit's sandbox keeps the stand-in from writing its call log: what it answered is in the unit's journal.
    journal = target.exec("journalctl -t v100box-power-limit --no-pager -o cat").splitlines()
    assert any(line.startswith("persistence mode: Persistence mode is already Enabled") for line in journal), journal
    assert "GPU 0: power limit 150 W: Power limit for GPU 0 was set to 150 W (stand-in)." in journal


def test_the_guard_warns_stops_and_starts_the_service_by_temperature(box):
    target, port = box["target"], box["body"]["base_port"]
    assert is_active(target, GUARD) == "active" and is_active(target, SERVICE) == "active"
    before = len(events(target))

    standin_smi.set_sample(target, reading(81, 70))
    found = wait_for(target, lambda e: any(x["kind"] == "warn" for x in e[before:]), "warn event")
    (warn,) = [x for x in found[before:] if x["kind"] == "warn"]
    assert warn["gpu"] == 0 and warn["temp_c"] == 81.0 and warn["memory_temp_c"] == 70.0 and warn["service"] is None
    assert is_active(target, SERVICE) == "active"

    standin_smi.set_sample(target, reading(86, 72))
    found = wait_for(target, lambda e: any(x["kind"] == "stop" for x in e[before:]), "stop event")
    (stop,) = [x for x in found[before:] if x["kind"] == "stop"]
    assert stop["service"] == SERVICE and stop["temp_c"] == 86.0 and "stop level" in stop["message"]
    assert is_active(target, SERVICE) == "inactive"
    assert [x["kind"] for x in found[before:]] == ["warn", "stop"]  # one warning per episode, none again at 86

    standin_smi.set_sample(target, reading(70, 60))
    found = wait_for(target, lambda e: any(x["kind"] == "start" for x in e[before:]), "start event")
    (start,) = [x for x in found[before:] if x["kind"] == "start"]
    assert start["service"] == SERVICE and start["temp_c"] == 70.0
    assert is_active(target, SERVICE) == "active" and healthy(target, port)
    for record in found[before:]:
        assert set(record) == {"time", "kind", "gpu", "temp_c", "memory_temp_c", "service", "message"}
        assert record["time"].endswith("+00:00")

    journal = target.exec("journalctl -t v100box-thermal-guard --no-pager -o cat")
    for record in (warn, stop, start):
        assert record["message"] in journal
    warnings = target.exec("journalctl -t v100box-thermal-guard --no-pager -o cat -p warning")
    assert stop["message"] in warnings and start["message"] not in warnings


def test_after_max_restarts_the_service_stays_stopped_until_the_guard_is_restarted(box):
    target, port = box["target"], box["body"]["base_port"]
    before = len(events(target))
    standin_smi.set_sample(target, reading(88))  # max_restarts 1: the first test used it
    found = wait_for(target, lambda e: any(x["kind"] == "limit" for x in e[before:]), "limit event")
    assert [x["kind"] for x in found[before:]] == ["stop", "limit"]
    standin_smi.set_sample(target, reading(60))
    time.sleep(3)  # three samples at 60 °C
    assert [x["kind"] for x in events(target)[before:]] == ["stop", "limit"]
    assert is_active(target, SERVICE) == "inactive"

    # The guard's stop outlives its restart within the boot: restarted, it starts the service it stopped.
    target.exec(f"systemctl restart {GUARD}")
    wait_for(target, lambda e: [x["kind"] for x in e[before:]] == ["stop", "limit", "start"], "start after restart")
    assert is_active(target, SERVICE) == "active" and healthy(target, port)


def test_a_failing_nvidia_smi_is_one_error_and_the_guard_keeps_running(box):
    target = box["target"]
    before = len(events(target))
    target.exec(f"rm -f {standin_smi.CAPTURE_DIR}/{standin_smi.SAMPLE_FILE}")
    found = wait_for(target, lambda e: any(x["kind"] == "error" for x in e[before:]), "error event")
    time.sleep(3)
    errors = [x for x in events(target)[before:] if x["kind"] == "error"]
    assert len(errors) == 1 and "nvidia-smi failed (exit 9)" in errors[0]["message"], found
    assert is_active(target, GUARD) == "active" and is_active(target, SERVICE) == "active"
    standin_smi.set_sample(target, reading(40))


def test_a_power_limit_outside_the_card_range_is_refused_before_anything_changes(box):
    target = box["target"]
    state, config = target.exec(f"cat {POWER_STATE}"), target.exec(f"cat {POWER_CONFIG}")
    since = target.exec("systemctl show -p ActiveEnterTimestampMonotonic --value v100box-power-limit.service")
    target.exec(f": > {standin_smi.CALL_LOG}")
    fleet = write_fleet(box["fleet"], box["body"], power_limit_w={0: 400})
    done = controller("provision", "lab1", "--fleet", str(fleet), "--json")
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert ("power_limit_w 400 for GPU 0 is outside what the card allows (100-300 W); set a value in that range in "
            "the fleet file") in output, output[-3000:]
    assert "Traceback" not in done.stderr
    assert target.exec(f"cat {POWER_STATE}") == state and target.exec(f"cat {POWER_CONFIG}") == config
    asked = standin_smi.calls(target)  # the probe's queries and the preflight's range, nothing that sets
    assert f"--query-gpu={standin_smi.POWER_QUERY} --format=csv,noheader,nounits" in asked
    assert [call for call in asked if call.startswith(("-pm", "-i"))] == []
    # the boot unit did not run again
    assert target.exec("systemctl show -p ActiveEnterTimestampMonotonic --value v100box-power-limit.service") == since
    write_fleet(box["fleet"], box["body"])  # as provisioned


def test_thresholds_out_of_order_are_refused_by_the_fleet_file(box, tmp_path):
    fleet = yaml.safe_load(box["fleet"].read_text())
    fleet["boxes"]["lab1"]["thermal"] = {"warn_c": 85, "stop_c": 80}
    path = tmp_path / "fleet.yml"
    path.write_text(yaml.safe_dump(fleet))
    done = controller("provision", "lab1", "--fleet", str(path))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "box 'lab1'" in lines[0] and "stop_c 80 must be above warn_c 85" in lines[0], lines


def provision_json(fleet: Path) -> tuple[dict, str]:
    done = controller("provision", "lab1", "--fleet", str(fleet), "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    changed = [line["task"] for line in lines if line.get("type") == "task" and line.get("status") == "changed"]
    return next(line for line in lines if line.get("type") == "summary"), ", ".join(changed)


def test_a_converged_rerun_changes_nothing_and_dropping_both_removes_them(box):
    target = box["target"]
    summary, changed = provision_json(box["fleet"])
    assert summary["hosts"]["lab1"]["changed"] == 0, changed
    assert is_active(target, GUARD) == "active"

    target.exec(f": > {standin_smi.CALL_LOG}")
    body = {**box["body"], "thermal": {"guard": False}}
    del body["power_limit_w"]
    summary, _changed = provision_json(write_fleet(box["fleet"], body))
    assert is_active(target, GUARD) == "inactive" and is_active(target, SERVICE) == "active"
    for path in ("/etc/systemd/system/v100box-thermal-guard.service", "/etc/systemd/system/v100box-power-limit.service",
                 POWER_CONFIG, POWER_STATE, "/etc/v100box/thermal-guard.json",
                 "/usr/local/lib/v100box/thermal_guard.py"):
        assert target.run(f"test -e {path}").returncode == 1, path
    assert "-i 0 -pl 250" in standin_smi.calls(target)  # the card's default limit again
    assert target.run(f"test -s {EVENTS}").returncode == 0  # the history stays
