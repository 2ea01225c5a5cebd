"""On-demand models on a real box (SSH into a systemd container, the CPU engine): two generated models in one group
behind one port and one key, served by llama-server's router mode; each answers in turn through both APIs, the
router unloads the other (at most one loaded), the models' own servers refuse requests without the key, status shows
which is loaded and a rerun changes nothing (issue 24)."""

from __future__ import annotations

import json
import re
import time
from functools import partial
from pathlib import Path

import httpx
import pytest
import yaml

from tests.cli import run_controller
from tests.integration.provisioned import provisioned_fleet

pytestmark = [pytest.mark.podman, pytest.mark.engine, pytest.mark.slow]

API_KEY = "sk-on-demand-key-never-logged-77"
FIRST, SECOND = "tiny-llama", "tiny-llama-tools"
UNIT = "llama-on-demand"
controller = partial(run_controller, timeout=900)


@pytest.fixture(scope="module")
def fleet_file(tmp_path_factory, lab_site, systemd_target):
    folder = tmp_path_factory.mktemp("on-demand")
    (folder / "api_key").write_text(API_KEY)
    box = {"models": [{"id": FIRST, "ctx": 2048, "on_demand": True}, {"id": SECOND, "ctx": 2048, "on_demand": True}],
           "on_demand_max": 1, "api_key": {"file": str(folder / "api_key")}}
    with provisioned_fleet(folder, lab_site, systemd_target, box, timeout=900) as path:
        yield path


def _base(fleet_file: Path) -> str:
    return f"http://127.0.0.1:{yaml.safe_load(fleet_file.read_text())['boxes']['lab1']['base_port']}"


def _statuses(base: str) -> dict[str, str]:
    listed = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    return {item["id"]: item["status"]["value"] for item in listed["data"]}


def _first_token(base: str, model: str) -> tuple[float, float]:
    """Seconds to the response headers and to the first streamed token of a turn for ``model``."""
    started = time.monotonic()
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status_code == 200, response.read()
        headers = time.monotonic() - started
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return headers, time.monotonic() - started
    raise AssertionError(f"{model}: no token streamed")


def test_the_plan_and_the_report_name_the_group_and_each_model_was_checked(fleet_file):
    inventory = fleet_file.parent / "inventory"
    plan = json.loads((inventory / "plans" / "lab1.json").read_text())
    (service,) = plan["services"]
    assert service["name"] == UNIT and service["models"] == [FIRST, SECOND]
    assert service["on_demand"]["max_loaded"] == 1 and "--models-max" in service["args"]
    assert "--model" not in service["args"]  # router mode: no model on its own command line
    report = json.loads((inventory / "reports" / "lab1.json").read_text())
    (checked,) = report["services"]
    assert checked["verified"] is True and checked["on_demand"]["models"] == [FIRST, SECOND]
    assert {model: checked["models"][model]["openai"]["object"] for model in (FIRST, SECOND)} == {
        FIRST: "chat.completion", SECOND: "chat.completion"}
    assert all(checked["models"][model]["auth"]["required"] for model in (FIRST, SECOND))


def test_both_models_answer_in_turn_through_one_port_and_key_and_the_router_swaps_them(fleet_file):
    base = _base(fleet_file)
    key = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 401
    assert set(_statuses(base)) == {FIRST, SECOND}
    timings = {}
    for turn, model in enumerate((FIRST, SECOND, FIRST)):
        chat = httpx.post(f"{base}/v1/chat/completions", headers=key, timeout=120, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion", chat.text
        message = httpx.post(f"{base}/v1/messages", timeout=120, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"})
        assert message.status_code == 200 and message.json()["type"] == "message", message.text
        other = SECOND if model == FIRST else FIRST
        assert _statuses(base) == {model: "loaded", other: "unloaded"}, turn  # at most one loaded
    # A swap, timed: the other model is unloaded, this one loaded before its first token.
    timings["swap"] = _first_token(base, SECOND)
    timings["warm"] = _first_token(base, SECOND)
    print(f"on-demand swap on the lab CPU engine: headers after {timings['swap'][0]:.3f} s, first token after "
          f"{timings['swap'][1]:.3f} s; loaded: {timings['warm'][1]:.3f} s")
    assert timings["swap"][1] < 60
    wrong = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": "Bearer wrong-key-000000000"},
                       timeout=30, json={"model": FIRST, "messages": [{"role": "user", "content": "hi"}]})
    assert wrong.status_code == 401
    unknown = httpx.post(f"{base}/v1/chat/completions", headers=key, timeout=30,
                         json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert unknown.status_code == 400 and "not found" in unknown.text


def test_the_models_own_servers_refuse_a_request_without_the_key(fleet_file, systemd_target):
    base = _base(fleet_file)
    _first_token(base, FIRST)  # loaded: its own server listens on a loopback port of its own
    router = systemd_target.exec(f"systemctl show --property MainPID --value {UNIT}").strip()
    children = systemd_target.exec(f"pgrep -P {router} || true").split()
    assert children, "the router runs no model server"
    listening = systemd_target.exec("ss -Hltnp")
    ports = {int(match) for child in children
             for match in re.findall(rf":(\d+)\s.*pid={child},", listening)}
    assert ports, listening
    for port in ports:
        bare = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                          json={"model": FIRST, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert bare.status_code == 401, (port, bare.text)  # the key reached it through the environment
        listed = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30)
        assert listed.status_code == 401


def test_status_shows_which_model_is_loaded_and_clients_list_both(fleet_file):
    base = _base(fleet_file)
    _first_token(base, SECOND)
    done = controller("status", "lab1", "--fleet", str(fleet_file), "--json")
    answer = json.loads(done.stdout)
    (box,) = answer["boxes"]
    (service,) = box["services"]
    assert done.returncode == 0 and box["drift"] == [], (done.stdout, done.stderr)
    assert service["healthy"] and service["models"] == [FIRST, SECOND] and service["loaded"] == [SECOND]
    human = controller("status", "lab1", "--fleet", str(fleet_file))
    assert f"{UNIT}: on demand {FIRST}, {SECOND}; loaded now: {SECOND}" in human.stdout
    clients = json.loads(controller("clients", "lab1", "--fleet", str(fleet_file), "--json").stdout)
    assert [(entry["model"], entry["base_url"]) for entry in clients["services"]] == [(FIRST, base), (SECOND, base)]
    assert clients["services"][1]["claude_code"]["env"]["ANTHROPIC_MODEL"] == SECOND


def test_certify_checks_each_model_of_the_group_and_records_each_first_turn(fleet_file):
    done = controller("certify", "lab1", "--fleet", str(fleet_file), "--json")
    answer = json.loads(done.stdout)
    endpoint = next(item for item in answer["checks"] if item["name"] == f"endpoint {UNIT}")
    assert endpoint["passed"], endpoint
    assert f"serves {FIRST}, {SECOND} on demand" in endpoint["detail"]
    assert re.search(rf"its load included: {FIRST} [0-9.]+ s, {SECOND} [0-9.]+ s", endpoint["detail"]), endpoint


def test_a_rerun_changes_nothing(fleet_file):
    done = controller("provision", "lab1", "--fleet", str(fleet_file), "--json")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    summary = next(line for line in lines if line.get("type") == "summary")
    assert done.returncode == 0 and summary["hosts"]["lab1"]["changed"] == 0, done.stdout[-3000:]
