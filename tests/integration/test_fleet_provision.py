"""Many boxes at once: `controller provision --all` over three systemd containers and one address nothing
listens on, in one Ansible run; one box fails in the run, one is unreachable, the others are provisioned
and verified; then a converged rerun of a fleet group, and plain ansible-playbook on the rendered inventory."""

from __future__ import annotations

import json
import os
import subprocess
from functools import partial

import httpx
import pytest
import yaml

from lab.fileserver import FileServer
from lab.target import free_port
from tests.cli import REPO, run_controller

pytestmark = [pytest.mark.podman, pytest.mark.engine, pytest.mark.slow]

controller = partial(run_controller, timeout=900)
BROKEN = "/root/.openclaw/openclaw.json"


def fleet_lines(done: subprocess.CompletedProcess[str]) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    summary = next((line for line in lines if line.get("type") == "fleet"), {})
    return summary, lines


def test_three_boxes_at_once_one_failing_one_unreachable_then_converged_and_plain_ansible(lab_site, target_factory,
                                                                                          tmp_path):
    root, catalog = lab_site
    targets = {name: target_factory() for name in ("lab1", "lab2", "lab3")}
    # lab3 fails inside the run: the llama_service role refuses an OpenClaw config that is not JSON5.
    targets["lab3"].exec(f"mkdir -p /root/.openclaw && cat > {BROKEN}", input="{ not: json5,, \n")
    keys = {name: f"sk-fleet-{name}-key-0123456789" for name in targets}
    boxes = {}
    for name, target in targets.items():
        (tmp_path / f"{name}.key").write_text(keys[name])
        boxes[name] = {"address": target.host, "port": target.ssh_port, "key": str(target.key),
                       "host_key": target.host_public_key(), "models": [{"id": "tiny-llama", "ctx": 2048}],
                       "base_port": free_port(), "api_key": {"file": str(tmp_path / f"{name}.key")}}
    boxes["ghost"] = {"address": "127.0.0.1", "port": free_port(), "key": str(targets["lab1"].key),
                      "models": [{"id": "tiny-llama", "ctx": 2048}]}
    with FileServer(root) as server:
        fleet = {"catalogs": [str(catalog)], "defaults": {"mirror": {"engines": f"{server.url}/engines",
                                                                       "models": server.url}},
                 "groups": {"labs": ["lab1", "lab2", "lab3"]}, "boxes": boxes}
        path = tmp_path / "fleet.yml"
        path.write_text(yaml.safe_dump(fleet))
        inventory = tmp_path / "inventory"

        done = controller("provision", "--all", "--fleet", str(path), "--json")
        summary, lines = fleet_lines(done)
        assert done.returncode == 8, done.stdout[-4000:] + done.stderr[-3000:]
        outcome = {box["box"]: box for box in summary["boxes"]}
        assert [outcome[name]["result"] for name in ("ghost", "lab1", "lab2", "lab3")] == [
            "unreachable", "ok", "ok", "failed"], summary
        assert outcome["lab1"]["verified"] and outcome["lab2"]["verified"] and not outcome["lab3"]["verified"]
        assert "cannot connect" in outcome["ghost"]["reason"] and f"{BROKEN} is not valid JSON5" in outcome["lab3"]["reason"]
        assert summary["failed"] == ["ghost", "lab3"] and summary["forks"] == 3
        (error,) = done.stderr.strip().splitlines()
        assert error.startswith("error: 2 of 4 boxes did not provision:") and "ghost: unreachable" in error
        # One run, its boxes in parallel: task events of the three boxes interleave.
        hosts = [line["host"] for line in lines if line.get("type") == "task"]
        assert {"lab1", "lab2", "lab3"} <= set(hosts) and "ghost" not in hosts
        assert hosts.index("lab3") < max(i for i, host in enumerate(hosts) if host == "lab1")
        for name in ("lab1", "lab2"):
            report = json.loads((inventory / "reports" / f"{name}.json").read_text())
            assert report["verified"] and report["run"]["status"] == "successful"
            # Each box got its own key: its own is taken, another box's is refused.
            base = report["services"][0]["endpoint"]
            other = keys["lab2" if name == "lab1" else "lab1"]
            assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {keys[name]}"},
                             timeout=10).status_code == 200
            assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {other}"},
                             timeout=10).status_code == 401
        assert json.loads((inventory / "reports" / "lab3.json").read_text())["run"]["status"] == "failed"
        for secret in keys.values():
            assert not any(secret.encode() in file.read_bytes() for file in inventory.rglob("*") if file.is_file())

        # The owner fixes lab3; the group runs again: lab1 and lab2 are converged, lab3 finishes.
        targets["lab3"].exec(["rm", "-f", BROKEN])
        again = controller("provision", "labs", "--fleet", str(path), "--json")
        summary, _lines = fleet_lines(again)
        assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-3000:]
        outcome = {box["box"]: box for box in summary["boxes"]}
        assert set(outcome) == {"lab1", "lab2", "lab3"} and all(box["verified"] for box in outcome.values())
        assert outcome["lab1"]["changed"] == 0 and outcome["lab2"]["changed"] == 0, summary
        # One task publishes the comparisons of the whole run: each box's report has its own.
        fast = {name: json.loads((inventory / "reports" / f"{name}.json").read_text())["fast_path"]
                for name in outcome}
        assert fast["lab1"] == fast["lab2"] == {"converged": True, "reasons": []}, fast
        assert fast["lab3"]["converged"] is False and fast["lab3"]["reasons"], fast

        # Plain Ansible on the rendered inventory of the whole fleet: every box is listed; the fleet's group
        # limits the run; each box's key comes in as a host variable, as the controller hands it over.
        hosts_yml = yaml.safe_load((inventory / "hosts.yml").read_text())
        assert set(hosts_yml["all"]["children"]["linux"]["hosts"]) == {"ghost", "lab1", "lab2", "lab3"}
        secrets = tmp_path / "secrets.yml"
        secrets.write_text(yaml.safe_dump({"all": {"hosts": {name: {"llama_service_api_key": key}
                                                             for name, key in keys.items()}}}))
        env = {key: value for key, value in os.environ.items() if not key.startswith("ANSIBLE_")}
        plain = subprocess.run([str(REPO / ".venv" / "bin" / "ansible-playbook"), "-i", str(inventory / "hosts.yml"),
                                "-i", str(secrets), "ansible_collections/v100box/llm/playbooks/site.yml", "--limit", "labs"],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
        assert plain.returncode == 0, plain.stdout[-4000:] + plain.stderr[-2000:]
        recap = plain.stdout.split("PLAY RECAP")[-1]
        for name in ("lab1", "lab2", "lab3"):
            line = next(line for line in recap.splitlines() if line.startswith(name))
            assert "changed=0" in line and "failed=0" in line and "unreachable=0" in line, recap
