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

from lab.target import free_port
from tests.cli import REPO, run_controller

pytestmark = [pytest.mark.podman, pytest.mark.engine, pytest.mark.slow]

API_KEY = "sk-e2e-api-key-never-logged-4242"
HF_TOKEN = "hf_e2e_token_never_logged_4242"


controller = partial(run_controller, timeout=900)


@pytest.fixture(scope="module")
def fleet_file(tmp_path_factory, site_server, systemd_target):
    server, catalog = site_server
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
    # A box never provisioned runs every role, under mitogen (controller/stages/strategy.py).
    assert summary["strategy"] == {"name": "mitogen_linear", "reason": "lab1 has no run that ended ok on record: "
                                                                       "every role is expected to run"}

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
    # Expected converged, it runs under the plain linear strategy, and the record the mitogen run left matches it:
    # the play ends after the one comparison.
    assert summary2["strategy"]["name"] == "linear"
    decisions = [json.loads(line) for line in done2.stdout.splitlines() if line.startswith('{"type": "fast_path"')]
    assert [(one["host"], one["converged"]) for one in decisions] == [("lab1", True)], decisions


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


def test_agent_clients_are_wired_and_a_users_openclaw_config_is_kept(fleet_file, systemd_target):
    """The Claude Code launch script and the OpenClaw merge on the box: an OpenClaw config that is not JSON5 is
    refused and left byte for byte; a valid one keeps the user's settings beside the box's provider."""
    import json5

    config = "/root/.openclaw/openclaw.json"
    broken = "// mine\n{ channels: { telegram: { enabled: true, } \n"
    systemd_target.exec(f"mkdir -p /root/.openclaw && cat > {config}", input=broken)
    _summary, _report, done = run_json(fleet_file)
    assert done.returncode == 5, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{config} is not valid JSON5" in done.stdout + done.stderr
    assert systemd_target.exec(["cat", config]) == broken

    mine = "// mine\n{ channels: { telegram: { enabled: true, botToken: '1:a' } }, agents: { defaults: { workspace: '~/w' } }, }\n"
    systemd_target.exec(f"cat > {config}", input=mine)
    _summary, report, done = run_json(fleet_file)
    assert done.returncode == 0 and report["verified"] is True, done.stdout[-3000:] + done.stderr[-3000:]
    merged = json5.loads(systemd_target.exec(["cat", config]))
    assert merged["channels"]["telegram"] == {"enabled": True, "botToken": "1:a"}
    assert merged["agents"]["defaults"]["workspace"] == "~/w"
    (model,) = merged["models"]["providers"]["v100-lab1"]["models"]
    assert merged["models"]["providers"]["v100-lab1"]["apiKey"] == API_KEY and model["id"] == "tiny-llama"
    assert model["contextWindow"] == 2048  # the context this fleet asks for
    script = "/root/.local/bin/claude-tiny-llama"
    modes = systemd_target.exec(["stat", "-c", "%a %U", script, config,
                                 "/root/.config/v100-llm-box/keys/llama-tiny-llama.key"]).split("\n")
    assert modes[:3] == ["700 root", "600 root", "600 root"]
    text = systemd_target.exec(["cat", script])
    assert API_KEY not in text and "export ANTHROPIC_MODEL=tiny-llama" in text
    assert "export CLAUDE_CODE_AUTO_COMPACT_WINDOW=2048" in text


# A stand-in for the `claude` program on the workstation: one Anthropic Messages request with exactly the
# environment the launch script exports (the test shows the wiring reaches the box, not Claude Code itself,
# which needs a Node the workstation image lacks; tests/integration/test_agent_clients.py runs the real one).
CLAUDE_STAND_IN = """#!/usr/bin/python3
import json, os, urllib.request
body = {"model": os.environ["ANTHROPIC_MODEL"], "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
request = urllib.request.Request(os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages", json.dumps(body).encode(),
                                 {"content-type": "application/json", "x-api-key": os.environ["ANTHROPIC_AUTH_TOKEN"],
                                  "anthropic-version": "2023-06-01"})
print(json.dumps({"reply": json.load(urllib.request.urlopen(request, timeout=60)),
                  "window": os.environ["CLAUDE_CODE_AUTO_COMPACT_WINDOW"]}))
"""


def test_a_workstation_of_the_fleet_gets_the_clients_wired_to_the_box(fleet_file, target_factory):
    """`controller provision WORKSTATION` on a second machine: launch scripts and key copies for two accounts, the
    OpenClaw config merged (an invalid one refused and left byte for byte), no key in the inventory, and the
    launch script's environment reaches the box's server."""
    import json5

    station = target_factory()
    station.exec("useradd --create-home dev && mkdir -p /root/.openclaw")
    station.exec("cat > /usr/local/bin/claude && chmod 755 /usr/local/bin/claude", input=CLAUDE_STAND_IN)
    fleet = yaml.safe_load(fleet_file.read_text())
    fleet["workstations"] = {"desk": {"address": station.host, "port": station.ssh_port, "user": "root",
                                      "key": str(station.key), "accounts": ["root", "dev"], "boxes": ["lab1"]}}
    path = fleet_file.with_name("fleet-desk.yml")  # beside fleet.yml: the same inventory, lab1's plan in it
    path.write_text(yaml.safe_dump(fleet))
    config = "/root/.openclaw/openclaw.json"
    broken = "{ gateway: { port: 18789, }\n"
    station.exec(f"cat > {config}", input=broken)
    done = controller("provision", "desk", "--fleet", str(path), "--json")
    assert done.returncode == 5 and f"{config} is not valid JSON5" in done.stdout + done.stderr, done.stdout[-3000:]
    assert station.exec(["cat", config]) == broken

    mine = "// mine\n{ gateway: { port: 18789 }, models: { providers: { other: { baseUrl: 'http://x/v1', models: [] } } } }\n"
    station.exec(f"cat > {config}", input=mine)
    done = controller("provision", "desk", "--fleet", str(path), "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    answer = next(json.loads(line) for line in done.stdout.splitlines() if '"type": "clients"' in line)
    (service,) = answer["services"]
    assert answer["accounts"] == ["root", "dev"] and service["script"] == "claude-tiny-llama"
    merged = json5.loads(station.exec(["cat", config]))
    assert merged["gateway"] == {"port": 18789} and "other" in merged["models"]["providers"]
    assert merged["models"]["providers"]["v100-lab1"]["apiKey"] == API_KEY
    assert merged["models"]["providers"]["v100-lab1"]["baseUrl"] == service["base_url"] + "/v1"
    for account, home in (("root", "/root"), ("dev", "/home/dev")):
        script, key = f"{home}/.local/bin/claude-tiny-llama", f"{home}/.config/v100-llm-box/keys/lab1.key"
        assert station.exec(["stat", "-c", "%a %U", script, key]).split("\n")[:2] == [f"700 {account}", f"600 {account}"]
        assert API_KEY not in station.exec(["cat", script]) and station.exec(["cat", key]).strip() == API_KEY
    assert station.exec(["stat", "-c", "%a", "/home/dev/.openclaw/openclaw.json"]).strip() == "600"
    inventory = fleet_file.parent / "inventory"
    assert (inventory / "workstations.yml").is_file() and (inventory / "host_vars" / "desk.yml").is_file()
    leaked = [str(file) for file in inventory.rglob("*") if file.is_file() and API_KEY.encode() in file.read_bytes()]
    assert leaked == []  # neither the rendered files nor the run's artifacts hold the key
    assert "lab1" not in yaml.safe_load((inventory / "workstations.yml").read_text().replace("!unsafe", ""))["all"][
        "children"]["workstations"]["hosts"]

    # dev's launch script, as dev: its environment (the key from dev's own copy) reaches the box's server.
    ran = json.loads(station.exec(["su", "-", "dev", "-c", "/home/dev/.local/bin/claude-tiny-llama"]))
    assert ran["reply"]["type"] == "message" and ran["reply"]["content"], ran
    assert ran["window"] == "2048"
    refused = station.exec(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", "x-api-key: wrong-key-0123456789",
                            "-H", "content-type: application/json", "-d", "{}", service["base_url"] + "/v1/messages"])
    assert refused.strip() == "401"

    again = controller("provision", "desk", "--fleet", str(path), "--json")  # converged: nothing changes
    summary = next(json.loads(line) for line in again.stdout.splitlines() if '"type": "summary"' in line)
    assert again.returncode == 0 and summary["hosts"]["desk"]["changed"] == 0, again.stdout[-3000:]

    # The account's own links never lead root's writes or reads out of its home (issue: root from a user's home).
    # Root's files the links point at, as they were before the run: owner, mode and content.
    station.exec("mkdir -p /etc/llama/keys && printf 'root-key\\n' > /etc/llama/keys/lab1.key && chmod 600 "
                 "/etc/llama/keys/lab1.key && printf 'root only\\n' > /root/secret.json && chmod 600 /root/secret.json")
    watched = ["/usr/local/bin", "/etc/llama/keys", "/etc/llama/keys/lab1.key", "/root/secret.json"]
    before = station.exec(["stat", "-c", "%n %U %G %a %s %Y", *watched])
    sums = station.exec(["sha256sum", "/etc/llama/keys/lab1.key", "/root/secret.json"])
    attacks = {
        "/home/dev/.local/bin": "/usr/local/bin",
        "/home/dev/.config/v100-llm-box/keys": "/etc/llama/keys",
        "/home/dev/.openclaw/openclaw.json": "/root/secret.json",
    }
    for link, target in attacks.items():
        station.exec(["su", "-", "dev", "-c", f"rm -rf {link} && ln -s {target} {link}"])
        done = controller("provision", "desk", "--fleet", str(path), "--json")
        assert done.returncode == 5, done.stdout[-3000:] + done.stderr[-3000:]
        assert f"{link} is a symbolic link" in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]
        assert station.exec(["stat", "-c", "%n %U %G %a %s %Y", *watched]) == before, link
        assert station.exec(["sha256sum", "/etc/llama/keys/lab1.key", "/root/secret.json"]) == sums, link
        assert "root only" not in station.exec(["su", "-", "dev", "-c", "cat ~/.openclaw/* 2>/dev/null; true"])
        station.exec(["su", "-", "dev", "-c", f"rm -f {link}"])
    done = controller("provision", "desk", "--fleet", str(path), "--json")  # the links gone: wired again
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert station.exec(["stat", "-c", "%a %U", "/home/dev/.local/bin/claude-tiny-llama"]).strip() == "700 dev"
