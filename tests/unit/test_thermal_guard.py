"""The thermal guard's decisions (roles/thermal_guard/files/thermal_guard.py, imported as the box runs it), its power
limit record against a stand-in nvidia-smi, and the fleet's `thermal:` and `power_limit_w:` with their projection."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from controller.errors import FleetError
from controller.model.fleet import parse_fleet
from controller.stages.render import thermal_vars
from lab import standin_smi

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ansible_collections/v100box/llm/roles" / "thermal_guard" / "files" / "thermal_guard.py"


def _load():
    spec = importlib.util.spec_from_file_location("thermal_guard_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


guard = _load()
CONFIG = guard.Config(services=("llama-a.service", "llama-b.service"), max_restarts=2)


def sample(*temps: float | None, memory: float | None = None) -> list:
    return [guard.Reading(index, temp, memory) for index, temp in enumerate(temps)]


def kinds(steps) -> list[str]:
    return [step.kind for step in steps]


def test_the_guard_and_the_stand_in_agree_on_the_queries():
    assert guard.SAMPLE_QUERY == standin_smi.SAMPLE_QUERY
    assert guard.POWER_QUERY == standin_smi.POWER_QUERY


def test_the_sample_is_read_from_what_nvidia_smi_prints():
    text = standin_smi.sample_csv([{"index": 0, "uuid": "GPU-a", "temperature.gpu": 86, "temperature.memory": 79},
                                   {"index": 1, "temperature.gpu": "41"}])
    assert guard.parse_sample(text) == [guard.Reading(0, 86.0, 79.0), guard.Reading(1, 41.0, None)]
    with pytest.raises(ValueError, match="not a reading"):
        guard.parse_sample("Failed to initialize NVML: Driver/library version mismatch\n")
    assert guard.parse_power("0, 100.00, 300.00, 250.00\n1, [N/A], [N/A], [N/A]\n") == {
        0: {"min": 100.0, "max": 300.0, "default": 250.0}, 1: {"min": None, "max": None, "default": None}}


def test_a_warning_once_per_episode_then_stop_then_start():
    state = guard.State()
    assert guard.decide(CONFIG, state, sample(60, 79.9), 0) == []
    steps = guard.decide(CONFIG, state, sample(60, 81), 1)
    assert kinds(steps) == ["warn"] and steps[0].gpu == 1 and steps[0].temp_c == 81
    assert guard.decide(CONFIG, state, sample(60, 83), 2) == []  # the same episode
    steps = guard.decide(CONFIG, state, sample(60, 85), 3)
    assert kinds(steps) == ["stop"] and steps[0].gpu == 1 and state.stopped
    assert guard.decide(CONFIG, state, sample(60, 90), 4) == []  # already stopped
    assert guard.decide(CONFIG, state, sample(60, 76), 5) == []  # above resume_c: still stopped
    steps = guard.decide(CONFIG, state, sample(60, 75), 6)
    assert kinds(steps) == ["start"] and not state.stopped
    assert kinds(guard.decide(CONFIG, state, sample(60, 80), 7)) == ["warn"]  # a new episode


def test_straight_to_the_stop_level_is_a_stop_without_a_warning():
    state = guard.State()
    assert kinds(guard.decide(CONFIG, state, sample(86, 40), 0)) == ["stop"]
    assert guard.decide(CONFIG, state, sample(82, 40), 1) == []


def test_the_memory_temperature_warns_and_stops_and_holds_the_restart():
    state = guard.State()
    assert kinds(guard.decide(CONFIG, state, sample(60, memory=86), 0)) == ["warn"]
    steps = guard.decide(CONFIG, state, sample(60, memory=91), 1)
    assert kinds(steps) == ["stop"] and steps[0].memory_temp_c == 91
    assert guard.decide(CONFIG, state, sample(60, memory=85), 2) == []  # memory not below its warning level
    assert kinds(guard.decide(CONFIG, state, sample(60, memory=84), 3)) == ["start"]


def test_after_max_restarts_in_an_hour_they_stay_stopped():
    state = guard.State()
    for now in (0, 10):  # two restarts allowed
        assert kinds(guard.decide(CONFIG, state, sample(90), now)) == ["stop"]
        assert kinds(guard.decide(CONFIG, state, sample(50), now + 1)) == ["start"]
    steps = guard.decide(CONFIG, state, sample(90), 20)
    assert kinds(steps) == ["stop", "limit"] and state.limited
    assert "max_restarts 2" in steps[1].message
    assert guard.decide(CONFIG, state, sample(50), 30) == []


def test_restarts_older_than_an_hour_do_not_count():
    state = guard.State()
    for now in (0, 10):
        guard.decide(CONFIG, state, sample(90), now)
        guard.decide(CONFIG, state, sample(50), now + 1)
    assert kinds(guard.decide(CONFIG, state, sample(90), 3700)) == ["stop"]
    assert kinds(guard.decide(CONFIG, state, sample(50), 3701)) == ["start"]


def test_no_restart_at_all_with_max_restarts_zero():
    state = guard.State()
    config = guard.Config(max_restarts=0)
    assert kinds(guard.decide(config, state, sample(90), 0)) == ["stop", "limit"]


def test_a_failing_nvidia_smi_is_one_error_per_episode_and_changes_nothing():
    state = guard.State(stopped=True)
    steps = guard.decide(CONFIG, state, None, 0, "nvidia-smi failed (exit 9): no captured output")
    assert kinds(steps) == ["error"] and "exit 9" in steps[0].message and steps[0].gpu is None
    assert guard.decide(CONFIG, state, None, 1, "again") == []
    assert kinds(guard.decide(CONFIG, state, [], 2)) == []  # still the same episode
    assert state.stopped  # unknown temperatures start nothing
    assert kinds(guard.decide(CONFIG, state, sample(50), 3)) == ["start"]
    assert kinds(guard.decide(CONFIG, state, None, 4, "gone")) == ["error"]  # a new episode


def test_a_gpu_that_reports_no_temperature_neither_stops_nor_blocks_a_start():
    state = guard.State(stopped=True)
    assert kinds(guard.decide(CONFIG, state, sample(None, 50), 0)) == ["start"]


def test_events_have_the_contract_fields():
    from datetime import datetime, timezone

    step = guard.Step("stop", 1, 86.0, None, "GPU 1 at 86 °C")
    record = guard.event(step, "llama-a.service", datetime(2026, 11, 24, 3, 0, tzinfo=timezone.utc))  # noqa: UP017
    assert record == {"time": "2026-11-24T03:00:00+00:00", "kind": "stop", "gpu": 1, "temp_c": 86.0,
                      "memory_temp_c": None, "service": "llama-a.service", "message": "GPU 1 at 86 °C"}


def test_act_stops_each_service_and_logs_a_failure_as_an_error(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run(argv, timeout=30):
        calls.append(argv)
        return (0, "") if argv[-1] == "llama-a.service" else (5, "Unit llama-b.service not loaded.")

    monkeypatch.setattr(guard, "run", fake_run)
    log = guard.Log(str(tmp_path / "events.jsonl"))
    guard.act(CONFIG, guard.Step("stop", 0, 86.0, None, "hot"), log)
    assert calls == [["/usr/bin/systemctl", "stop", "llama-a.service"], ["/usr/bin/systemctl", "stop", "llama-b.service"]]
    records = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["service"]) for r in records] == [("stop", "llama-a.service"), ("error", "llama-b.service")]
    assert "not loaded" in records[1]["message"]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "<4>stop: hot [llama-a.service]" and out[1].startswith("<3>error: systemctl stop llama-b.service")


def test_the_config_file_loads_with_what_the_role_writes(tmp_path):
    path = tmp_path / "thermal-guard.json"
    path.write_text(json.dumps({"services": ["llama-a.service"], "warn_c": 70.0, "stop_c": 80.0, "resume_c": 60.0,
                                "memory_warn_c": 85.0, "memory_stop_c": 90.0, "interval_s": 1.0, "max_restarts": 3,
                                "events": "/x/events.jsonl", "state": "/x/state.json"}))
    config = guard.Config.load(str(path))
    assert config.services == ("llama-a.service",) and config.stop_c == 80.0 and config.interval_s == 1.0


@pytest.fixture
def smi(tmp_path: Path) -> Path:
    """The lab's stand-in nvidia-smi, run here by sh, with a V100's power range."""
    captures, log = tmp_path / "captures", tmp_path / "calls"
    captures.mkdir()
    (captures / standin_smi.POWER_FILE).write_text(standin_smi.power_csv(
        [{"index": 0, "power.min_limit": "100.00", "power.max_limit": "300.00", "power.default_limit": "250.00"},
         {"index": 1, "power.min_limit": "100.00", "power.max_limit": "300.00", "power.default_limit": "250.00"}]))
    script = tmp_path / "nvidia-smi"
    script.write_text(standin_smi.standin_script(str(captures), str(log)))
    script.chmod(0o755)
    return script


def test_power_limits_are_applied_and_recorded_then_reset(tmp_path, smi):
    config, state = tmp_path / "power-limit.json", tmp_path / "state" / "power-limit.json"
    config.write_text(json.dumps({"limits": [{"gpu": 0, "watts": 150}, {"gpu": 1, "watts": 120}]}))
    code = guard.main(["power-limit", "--config", str(config), "--state", str(state), "--nvidia-smi", str(smi)])
    assert code == 0
    assert json.loads(state.read_text()) == {"persistence": True, "limits": [
        {"gpu": 0, "watts": 150, "applied": True, "range": [100.0, 300.0]},
        {"gpu": 1, "watts": 120, "applied": True, "range": [100.0, 300.0]}]}
    assert guard.main(["power-limit", "--reset", "--config", str(config), "--state", str(state),
                       "--nvidia-smi", str(smi)]) == 0
    assert not state.exists()
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c for c in calls if "-pl" in c or c == "-pm 1"] == ["-pm 1", "-i 0 -pl 150", "-i 1 -pl 120",
                                                                 "-i 0 -pl 250", "-i 1 -pl 250"]


def test_a_limit_the_driver_refuses_is_recorded_and_fails_the_unit(tmp_path, smi):
    config, state = tmp_path / "power-limit.json", tmp_path / "power-limit-state.json"
    config.write_text(json.dumps({"limits": [{"gpu": 0, "watts": 150}]}))
    broken = tmp_path / "broken-smi"
    broken.write_text("#!/bin/sh\necho 'Failed to initialize NVML' >&2\nexit 9\n")
    broken.chmod(0o755)
    assert guard.main(["power-limit", "--config", str(config), "--state", str(state), "--nvidia-smi", str(broken)]) == 1
    assert json.loads(state.read_text()) == {"persistence": False, "limits": [
        {"gpu": 0, "watts": 150, "applied": False, "range": [None, None]}]}


def _fleet(**box):
    return parse_fleet({"boxes": {"b1": {"address": "192.0.2.10", **box}}}, Path("fleet.yml"))


@pytest.mark.parametrize(("thermal", "message"), [
    ({"warn_c": 85, "stop_c": 80}, "stop_c 80 must be above warn_c 85"),
    ({"warn_c": 80, "stop_c": 80}, "stop_c 80 must be above warn_c 80"),
    ({"resume_c": 80}, "resume_c 80 must be below warn_c 80"),
    ({"memory_warn_c": 90, "memory_stop_c": 88}, "memory_stop_c 88 must be above memory_warn_c 90"),
    ({"interval_s": 0}, "interval_s"),
    ({"stop_c": 85, "hot": 1}, "unknown field"),
])
def test_thermal_settings_out_of_order_are_one_line_naming_the_box(thermal, message):
    with pytest.raises(FleetError) as caught:
        _fleet(thermal=thermal)
    text = str(caught.value)
    assert message in text and "box 'b1'" in text and len(text.splitlines()) == 1, text


@pytest.mark.parametrize(("value", "message"), [
    (0, "0 is not a power limit"),
    ({0: 5000}, "GPU 0: 5000 is not a power limit"),
    ({"x": 100}, "GPU 'x' is not a GPU index"),
    ("lots", "'lots' is not a power limit"),
])
def test_power_limits_that_cannot_be_watts_are_one_line(value, message):
    with pytest.raises(FleetError) as caught:
        _fleet(power_limit_w=value)
    assert message in str(caught.value) and len(str(caught.value).splitlines()) == 1


def test_power_limits_on_windows_are_refused():
    with pytest.raises(FleetError, match="Linux boot unit"):
        _fleet(os="windows", power_limit_w=100, transport="winrm", password={"env": "X"})


class _Plan:
    def __init__(self, *gpus: list[int]):
        self.services = [type("Service", (), {"name": f"llama-{i}", "gpus": g})() for i, g in enumerate(gpus)]


def test_the_guard_is_on_by_default_only_where_a_service_runs_on_a_gpu():
    box = _fleet(power_limit_w={"1": 150}).boxes["b1"]
    assert thermal_vars(box, _Plan([])) == {"thermal_guard_enabled": False, "thermal_guard_power_limit_w": {1: 150}}
    on = thermal_vars(box, _Plan([], [0, 1]))
    assert on["thermal_guard_enabled"] is True
    assert on["thermal_guard_services"] == ["llama-0.service", "llama-1.service"]
    assert (on["thermal_guard_warn_c"], on["thermal_guard_stop_c"], on["thermal_guard_resume_c"]) == (80, 85, 75)
    forced = _fleet(thermal={"guard": False}).boxes["b1"]
    assert thermal_vars(forced, _Plan([0])) == {"thermal_guard_enabled": False}
    windows = _fleet(os="windows", transport="winrm", password={"env": "X"}, thermal={"guard": True}).boxes["b1"]
    assert thermal_vars(windows, _Plan([]))["thermal_guard_services"] == ["llama-0"]


def test_a_sample_ignores_what_nvidia_smi_says_on_stderr_when_it_succeeds(tmp_path):
    noisy = tmp_path / "nvidia-smi"
    noisy.write_text("#!/bin/sh\necho 'WARNING: infoROM is corrupted at gpu 0000:3B:00.0' >&2\n"
                     "echo '0, GPU-a, 83, [N/A], 250.1, 300.00, 1530, 877, 0x0000000000000000'\n")
    noisy.chmod(0o755)
    assert guard.sample(guard.Config(nvidia_smi=str(noisy))) == ([guard.Reading(0, 83.0, None)], "")
    missing = guard.sample(guard.Config(nvidia_smi=str(tmp_path / "absent")))
    assert missing[0] is None and "is not installed" in missing[1]
