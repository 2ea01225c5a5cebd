"""End to end: `controller provision` over real SSH into a systemd container, the real CPU engine,
a generated model served from a local download site, then both APIs, idempotence and secrets."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import httpx
import pytest
import yaml

from lab.fileserver import FileServer
from lab.target import free_port
from tests.cli import REPO, run_controller

pytestmark = [pytest.mark.podman, pytest.mark.engine, pytest.mark.slow]

API_KEY = "sk-e2e-api-key-never-logged-4242"
HF_TOKEN = "hf_e2e_token_never_logged_4242"


controller = partial(run_controller, timeout=900)


@pytest.fixture(scope="module")
def site(lab_site):
    root, catalog = lab_site
    with FileServer(root) as server:
        yield server, catalog


@pytest.fixture(scope="module")
def fleet_file(tmp_path_factory, site, systemd_target):
    server, catalog = site
    folder = tmp_path_factory.mktemp("fleet")
    (folder / "api_key").write_text(API_KEY)
    (folder / "hf_token").write_text(HF_TOKEN)
    port = free_port()
    fleet = {
        "catalogs": [str(catalog)],
        "boxes": {
            "lab1": {
                "address": systemd_target.host,
                "port": systemd_target.ssh_port,
                "user": "root",
                "key": str(systemd_target.key),
                "models": [{"id": "tiny-llama", "ctx": 2048}],
                "base_port": port,
                "api_key": {"file": str(folder / "api_key")},
                "hf_token": {"file": str(folder / "hf_token")},
                "mirror": {"engines": f"{server.url}/engines", "models": server.url},
            },
            "nobody": {"address": "127.0.0.1", "port": free_port(), "key": str(systemd_target.key),
                       "models": [{"id": "tiny-llama"}]},
        },
    }
    path = folder / "fleet.yml"
    path.write_text(yaml.safe_dump(fleet))
    return path


def run_json(fleet_file: Path) -> tuple[dict, dict, subprocess.CompletedProcess]:
    done = controller("provision", "lab1", "--fleet", str(fleet_file), "--json")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    summary = next((line for line in lines if line.get("type") == "summary"), {})
    report = next((line for line in lines if line.get("type") == "report"), {})
    return summary, report, done


def test_provision_serves_both_apis_then_converges(fleet_file, systemd_target):
    summary, report, done = run_json(fleet_file)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["verified"] is True
    (service,) = report["services"]
    assert service["served_ids"] == ["tiny-llama"]
    assert service["openai"]["completion_tokens"] > 0 and service["anthropic"]["output_tokens"] > 0
    assert summary["hosts"]["lab1"]["changed"] > 0

    # The service runs under systemd as the unprivileged user, and answers from the host too
    # (the target shares the host's loopback).
    user = systemd_target.exec(f"systemctl show -p User --value {service['name']}.service").strip()
    assert user == "llama"
    # The key reaches the server as a file (systemd credential): ps shows the path, never the key, and
    # verification proved a request without it (or with a wrong one) is refused.
    assert service["auth"] == {"required": True, "anonymous_status": 401, "wrong_key_status": 401}
    command_line = systemd_target.exec("ps -o args= -C llama-server")
    assert "--api-key-file" in command_line and API_KEY not in command_line
    base = service["endpoint"]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    chat = httpx.post(f"{base}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    message = httpx.post(f"{base}/v1/messages", headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"},
                         timeout=60, json={"model": "tiny-llama", "max_tokens": 4,
                                           "messages": [{"role": "user", "content": "hi"}]}).json()
    assert message["type"] == "message" and message["role"] == "assistant"

    summary2, report2, done2 = run_json(fleet_file)
    assert done2.returncode == 0, done2.stdout[-3000:] + done2.stderr[-3000:]
    changed = [line for line in done2.stdout.splitlines() if '"changed"' in line]
    assert summary2["hosts"]["lab1"]["changed"] == 0, changed
    assert report2["verified"] is True


def test_verify_checks_the_provisioned_box_again(fleet_file):
    """`controller verify` runs verify.yml on the rendered box and prints what each server answered."""
    report = json.loads((fleet_file.parent / "inventory" / "reports" / "lab1.json").read_text())
    done = controller("verify", "lab1", "--fleet", str(fleet_file), "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    summary = next(line for line in lines if line.get("type") == "summary")
    assert summary["playbook"] == "verify.yml" and summary["hosts"]["lab1"]["changed"] == 0
    (service,) = report["services"]
    section = lines[-1]
    assert set(section) == {service["name"]}
    checked = section[service["name"]]
    assert set(checked) == {"model", "port", "health", "served_ids", "openai", "anthropic", "auth"}
    assert checked["health"] == "ok" and checked["served_ids"] == ["tiny-llama"]
    assert checked["auth"] == {"required": True, "anonymous_status": 401, "wrong_key_status": 401}
    assert API_KEY not in done.stdout + done.stderr

    unrendered = controller("verify", "nobody", "--fleet", str(fleet_file))
    assert unrendered.returncode == 1 and "has no rendered inventory for nobody" in unrendered.stderr
    assert "Traceback" not in unrendered.stderr and len(unrendered.stderr.strip().splitlines()) == 1


def test_secrets_never_reach_artifacts_inventory_or_output(fleet_file):
    summary, _report, done = run_json(fleet_file)  # runs after the first test in this module, converged
    assert done.returncode == 0
    inventory = fleet_file.parent / "inventory"
    files = [path for path in inventory.rglob("*") if path.is_file()]
    assert any("artifacts" in path.parts for path in files)
    for path in files:
        data = path.read_bytes()
        assert API_KEY.encode() not in data and HF_TOKEN.encode() not in data, path
    assert API_KEY not in done.stdout + done.stderr and HF_TOKEN not in done.stdout + done.stderr


def test_ctrl_c_stops_the_run_writes_where_and_the_next_run_converges(fleet_file):
    """Ctrl-C during a real provision: ansible-playbook stops, the report names the task, exit 130."""
    started = subprocess.Popen([sys.executable, "-m", "controller", "provision", "lab1", "--fleet", str(fleet_file),
                                "--json"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in started.stdout:  # the first task event: the play is under way on the box
            seen.append(line)
            if line.startswith('{"type": "task"'):
                break
        started.send_signal(signal.SIGINT)
        out, err = started.communicate(timeout=120)
    finally:
        if started.poll() is None:
            started.kill()
    assert started.returncode == 130, "".join(seen) + out + err
    assert "Traceback" not in err and "interrupted during task" in err
    report = json.loads((fleet_file.parent / "inventory" / "reports" / "lab1.json").read_text())
    assert report["run"]["status"] == "interrupted" and report["run"]["stopped_at"]
    assert report["verified"] is False
    leftover = subprocess.run(["pgrep", "-f", f"ansible-playbook.*{fleet_file.parent}"], capture_output=True,
                              text=True, check=False)
    assert leftover.stdout == "", leftover.stdout

    summary, report, done = run_json(fleet_file)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["verified"] is True and summary["hosts"]["lab1"]["changed"] == 0


def test_unreachable_box_is_one_clear_line(fleet_file):
    done = controller("provision", "nobody", "--fleet", str(fleet_file))
    assert done.returncode == 3
    assert "box nobody (127.0.0.1:" in done.stderr and "cannot connect" in done.stderr
    assert "Traceback" not in done.stderr


def test_wrong_key_is_one_clear_line(fleet_file, tmp_path):
    key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    fleet = yaml.safe_load(fleet_file.read_text())
    fleet["boxes"]["lab1"]["key"] = str(key)
    path = tmp_path / "fleet.yml"
    path.write_text(yaml.safe_dump(fleet))
    done = controller("provision", "lab1", "--fleet", str(path))
    assert done.returncode == 3
    assert "box lab1" in done.stderr and "authentication failed" in done.stderr and "Traceback" not in done.stderr


def test_unknown_model_id_names_the_id_and_the_file(fleet_file, tmp_path):
    fleet = yaml.safe_load(fleet_file.read_text())
    fleet["boxes"]["lab1"]["models"] = [{"id": "no-such-model"}]
    path = tmp_path / "fleet.yml"
    path.write_text(yaml.safe_dump(fleet))
    done = controller("provision", "lab1", "--fleet", str(path))
    assert done.returncode == 2 and "unknown model id 'no-such-model'" in done.stderr and str(path) in done.stderr
