"""`controller status` against a real provisioned box (SSH into a systemd container, the CPU engine, a tiny
model): healthy without drift, then hand edits on the box reported as drift with their fix while status leaves
the box as it found it, a box that is down reported as unreachable in the same run, and provision bringing it
back."""

from __future__ import annotations

import base64
import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import yaml

from lab import aptrepo, standin_smi
from tests.cli import run_controller
from tests.integration.provisioned import provisioned_fleet

pytestmark = [pytest.mark.podman, pytest.mark.engine, pytest.mark.slow]

controller = partial(run_controller, timeout=600)
UNIT = "/etc/systemd/system/llama-tiny-llama.service"
NCCL = aptrepo.NCCL_VERSIONS[0]  # the CUDA 12 build, 2.27.7
MODEL = "/var/lib/llama/models/tiny-llama-128k-q8_0.gguf"
# Written for this test (not a capture): what the status query asks nvidia-smi, for one V100 whose memory the
# servers use; the stand-in prints it for any --query-gpu.
SMI_QUERY = ("index, name, driver_version, temperature.gpu, memory.used [MiB], memory.total [MiB]\n"
             "0, Tesla V100-PCIE-32GB, 580.82.07, 47, 1234 MiB, 32768 MiB\n")


@pytest.fixture(scope="module")
def fleet_file(tmp_path_factory, lab_site, systemd_target):
    folder = tmp_path_factory.mktemp("status")
    # lab2: provisioned once (its plan and host_vars copied from lab1's below), now down
    with provisioned_fleet(folder, lab_site, systemd_target, {"models": [{"id": "tiny-llama", "ctx": 2048}]},
                           timeout=600) as path:
        inventory = folder / "inventory"
        for kind, suffix in (("plans", "json"), ("host_vars", "yml")):  # lab2's plan, as its provision left it
            shutil.copy(inventory / kind / f"lab1.{suffix}", inventory / kind / f"lab2.{suffix}")
        # status reads the GPUs; a later provision would probe this V100 and plan the GPU engine, so the
        # stand-in goes again before the test that provisions
        standin_smi.install(systemd_target, {"nvidia-smi-query.csv": SMI_QUERY})
        yield path


def status(fleet_file: Path, *boxes: str) -> tuple[dict, int, str]:
    done = controller("status", *boxes, "--fleet", str(fleet_file), "--json")
    assert "Traceback" not in done.stderr, done.stderr
    return json.loads(done.stdout), done.returncode, done.stderr


def test_a_provisioned_box_is_healthy_without_drift(fleet_file):
    answer, code, err = status(fleet_file, "lab1")
    assert code == 0, (answer, err)
    (box,) = answer["boxes"]
    assert box["name"] == "lab1" and box["reachable"] is True and box["drift"] == []
    (service,) = box["services"]
    port = yaml.safe_load(fleet_file.read_text())["boxes"]["lab1"]["base_port"]
    assert {key: service[key] for key in ("model", "port", "active", "healthy", "served_model")} == {
        "model": "tiny-llama", "port": port, "active": True, "healthy": True, "served_model": "tiny-llama"}
    assert box["engines"][0]["running"] == box["engines"][0]["planned"]
    assert box["models"][0]["ok"] is True and box["models"][0]["size_bytes"] > 0
    assert box["gpus"] == [{"index": 0, "name": "Tesla V100-PCIE-32GB", "driver_version": "580.82.07",
                            "temperature_c": 47, "memory_used_mib": 1234, "memory_total_mib": 32768,
                            "memory_planned_mib": None}]
    human = controller("status", "lab1", "--fleet", str(fleet_file))
    assert human.returncode == 0 and "lab1: healthy, no drift" in human.stdout


def test_hand_edits_are_drift_with_their_fix_and_status_changes_nothing(fleet_file, systemd_target):
    systemd_target.exec(f"sed -i 's/^RestartSec=5$/RestartSec=9/' {UNIT} && systemctl daemon-reload && "
                        "systemctl disable --now llama-tiny-llama.service")
    # Same bytes, another file written now. (A copy that keeps the mtime could even get the old inode number
    # back once the original is unlinked: the install record could not tell it apart, and nor need it.)
    systemd_target.exec(f"cp {MODEL} {MODEL}.new && mv {MODEL}.new {MODEL}")
    current = systemd_target.exec("readlink /opt/llama/cpu/current").strip()
    systemd_target.exec(f"cp -a /opt/llama/cpu/{current} /opt/llama/cpu/0000000 && "
                        "ln -sfn 0000000 /opt/llama/cpu/current")
    unit_before = systemd_target.exec(f"sha1sum {UNIT}")

    answer, code, err = status(fleet_file, "lab1", "lab2")
    assert code == 3, (answer, err)  # a box down comes first; the other is still read
    lab1, lab2 = answer["boxes"]
    assert lab2["name"] == "lab2" and lab2["reachable"] is False and lab2["error"]
    assert lab1["reachable"] is True
    drift = {entry["what"]: entry for entry in lab1["drift"]}
    assert set(drift) == {"unit-edited", "service-stopped", "service-disabled", "model-replaced", "engine-switched"}
    assert all(entry["fix"].startswith(f"controller provision lab1 --fleet {fleet_file}") for entry in drift.values())
    assert UNIT in drift["unit-edited"]["detail"]
    assert f"points at 0000000, the plan says {current}" in drift["engine-switched"]["detail"]
    (service,) = lab1["services"]
    assert service["active"] is False and service["healthy"] is False

    # read-only: the unit is still the edited one, the service still stopped and disabled, the link still moved
    assert systemd_target.exec(f"sha1sum {UNIT}") == unit_before
    assert systemd_target.run("systemctl is-active llama-tiny-llama.service").stdout.strip() == "inactive"
    assert systemd_target.run("systemctl is-enabled llama-tiny-llama.service").stdout.strip() == "disabled"
    assert systemd_target.exec("readlink /opt/llama/cpu/current").strip() == "0000000"

    _answer, alone, _err = status(fleet_file, "lab1")
    assert alone == 6  # without the box that is down: a stopped server
    human = controller("status", "lab1", "--fleet", str(fleet_file))
    assert "drift unit-edited" in human.stdout and "fix: controller provision lab1" in human.stdout

    systemd_target.exec(f"rm -f {standin_smi.STANDIN_PATH}")  # a CPU box again, as it was provisioned
    done = controller("provision", "lab1", "--fleet", str(fleet_file), "--json")  # the fix it names
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The box's record of its last full run named the differences, so every role ran (no converged fast path).
    (decision,) = _events(done.stdout, "fast_path")
    assert decision["converged"] is False and any(UNIT in reason for reason in decision["reasons"]), decision
    answer, code, err = status(fleet_file, "lab1")
    assert code == 0 and answer["boxes"][0]["drift"] == [], (answer, err)


# A converged box's tasks.
FAST_PATH = ["Compare the box with the record of its last full run, and check its servers when it matches",
             "Publish the comparisons and the converged boxes' checks for the boxes' reports"]


def _events(stdout: str, kind: str) -> list[dict]:
    return [event for event in map(json.loads, stdout.splitlines()) if event.get("type") == kind]


def test_a_converged_box_ends_after_one_comparison_and_full_runs_every_role(fleet_file, systemd_target, tmp_path):
    done = controller("provision", "lab1", "--fleet", str(fleet_file), "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (decision,) = _events(done.stdout, "fast_path")
    assert decision["converged"] is True and decision["entries"] > 10, decision
    tasks = _events(done.stdout, "task")
    assert not [task for task in tasks if task["status"] in ("changed", "failed")], tasks
    # 2 task events on one box: the comparison that checks the servers in the same module run, and one publishing
    # every box's comparison and checks (NCCL is not used here). No role ran, and no task gathered facts.
    assert [task["task"] for task in tasks] == FAST_PATH, tasks
    (report,) = _events(done.stdout, "report")
    # The verdict rests on this run's turns through both APIs and the key's refusals, published by the fast path.
    (service,) = report["services"]
    assert report["verified"] is True and service["openai"]["object"] == "chat.completion", report
    assert service["anthropic"]["type"] == "message" and service["auth"]["anonymous_status"] == 401, service
    written = fleet_file.parent / "inventory" / "reports" / "lab1.json"  # the box's report says what this run was
    assert json.loads(written.read_text())["fast_path"] == {"converged": True, "reasons": []}

    # The box's facts no longer cached (the controller's runs keep them a day): the comparison gathers them itself, the
    # box is still converged after the same 2 tasks, and the cache has the facts the roles read again.
    facts = fleet_file.parent / "inventory" / "facts"
    for cached in facts.glob("*lab1"):
        cached.unlink()
    done = controller("provision", "lab1", "--fleet", str(fleet_file), "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (decision,) = _events(done.stdout, "fast_path")
    assert decision["converged"] is True, decision
    assert [task["task"] for task in _events(done.stdout, "task")] == FAST_PATH
    (cached,) = facts.glob("*lab1")
    gathered = json.loads(json.loads(cached.read_text())["__payload__"])
    assert (gathered["ansible_os_family"], gathered["ansible_pkg_mgr"]) == ("Debian", "apt"), sorted(gathered)

    # A drift no status check names: a file a role manages, its mode changed by hand.
    systemd_target.exec("chmod 0644 /etc/llama/llama-tiny-llama.env")
    done = controller("provision", "lab1", "--fleet", str(fleet_file), "--json")
    (decision,) = _events(done.stdout, "fast_path")
    assert decision["converged"] is False and decision["reasons"] == [
        "/etc/llama/llama-tiny-llama.env: mode changed"], decision
    assert json.loads(written.read_text())["fast_path"] == {
        "converged": False, "reasons": ["/etc/llama/llama-tiny-llama.env: mode changed"]}
    assert systemd_target.exec("stat -c %a /etc/llama/llama-tiny-llama.env").strip() == "600"

    # From here the box's servers are checked with NCCL (llama_verify_nccl, as for servers that all-reduce through
    # it), against the lab's stand-in libnccl.so.2 (its ncclGetVersion reports the version it was built as).
    library = aptrepo.compile_nccl(NCCL, tmp_path)
    systemd_target.exec("base64 -d > /usr/local/lib/libnccl.so.2 && ldconfig", input=base64.b64encode(library).decode())
    fleet = yaml.safe_load(fleet_file.read_text())
    fleet["boxes"]["lab1"]["vars"] = {"llama_verify_nccl": True}
    fleet_file.write_text(yaml.safe_dump(fleet))
    try:
        full = controller("provision", "lab1", "--fleet", str(fleet_file), "--json", "--full")
        assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
        (decision,) = _events(full.stdout, "fast_path")
        assert decision == {"type": "fast_path", "host": "lab1", "converged": False,
                            "reasons": ["a full run was asked for"], "entries": 0}
        tasks = _events(full.stdout, "task")
        assert len(tasks) > 100 and not [task for task in tasks if task["status"] in ("changed", "failed")]
        assert "Load NCCL and ask its version" in {task["task"] for task in tasks}

        # Converged: the comparison checks the servers, then NCCL is loaded again and published with their answers.
        done = controller("provision", "lab1", "--fleet", str(fleet_file), "--json")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        (decision,) = _events(done.stdout, "fast_path")
        assert decision["converged"] is True, decision
        names = [task["task"] for task in _events(done.stdout, "task")]
        assert names[:2] == FAST_PATH, names
        assert {"Load NCCL and ask its version", "Publish the NCCL version of a converged box"} <= set(names), names
        published = _published(fleet_file)["llama_verify"]["lab1"]
        assert published["nccl"]["version"] == NCCL.split("-")[0], published
        assert published["llama-tiny-llama"]["openai"]["object"] == "chat.completion", published

        # NCCL gone (nothing a role manages): still converged, and the run fails saying NCCL does not load.
        systemd_target.exec("rm /usr/local/lib/libnccl.so.2 && ldconfig")
        broken = controller("provision", "lab1", "--fleet", str(fleet_file), "--json")
        (decision,) = _events(broken.stdout, "fast_path")
        assert broken.returncode != 0 and decision["converged"] is True, broken.stdout[-3000:]
        assert "NCCL is not usable on this box" in broken.stdout + broken.stderr, broken.stdout[-3000:]
    finally:
        systemd_target.exec("rm -f /usr/local/lib/libnccl.so.2 && ldconfig")
        del fleet["boxes"]["lab1"]["vars"]
        fleet_file.write_text(yaml.safe_dump(fleet))


def _published(fleet_file: Path) -> dict:
    """What the last run published with set_stats (ansible-runner's artifacts of it)."""
    runs = sorted((fleet_file.parent / "inventory" / "artifacts").iterdir(), key=lambda path: path.stat().st_mtime)
    for event in (runs[-1] / "job_events").iterdir():
        data = json.loads(event.read_text())
        if data.get("event") == "playbook_on_stats":
            return data["event_data"]["artifact_data"]
    raise AssertionError(f"no stats in {runs[-1]}")


def test_bad_input_is_one_line(fleet_file):
    done = controller("status", "nosuch", "--fleet", str(fleet_file))
    assert done.returncode == 2 and "no box or group named 'nosuch'" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    both = controller("status", "lab1", "--all", "--fleet", str(fleet_file))
    assert both.returncode == 2 and "not both" in both.stderr
