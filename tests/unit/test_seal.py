"""controller seal, without a box: what it refuses before any connection, what it answers for a sealed box, and
where the new keys go (the run's secrets and the buyer's copy; never the inventory, the fleet or the builder's
report). The run itself is tests/integration/test_seal.py."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.actions.seal import BoxSealed, changes, check_certified, check_sealable, new_keys, seal, sealed_at
from controller.errors import FleetError, NotRendered, RunError, SealRefused
from controller.model.fleet import API_KEY_RULE, WantedModel, load_fleet
from controller.stages.planner import plan_models
from controller.stages.runner import RunResult
from tests.cli import invoke, run_controller
from tests.unit.clean_errors import assert_one_line_error
from tests.unit.planner.helpers import CPU_ONLY, catalog, profile

MODEL = "qwen2.5-coder-0.5b-instruct-q8_0"
BUYER_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDsv2bWb8pdJ8h5bpWlT6gIVr8e1q5v9mP0sDbHkzXgQ buyer@laptop"
CHANGED = ["rotated the API key of llama-x", "removed the authorized SSH keys of root"]


def _fleet(tmp_path: Path, **box: Any) -> Path:
    body = {"boxes": {"box1": {"address": "192.0.2.7", "models": [{"id": MODEL}], **box},
                      "win": {"address": "192.0.2.8", "os": "windows", "models": [{"id": MODEL}]}}}
    path = tmp_path / "fleet.yml"
    path.write_text(yaml.safe_dump(body))
    return path


def _plan(inventory: Path, box: str = "box1") -> None:
    result = plan_models([WantedModel(id=MODEL)], profile(CPU_ONLY), catalog())
    (inventory / "plans").mkdir(parents=True, exist_ok=True)
    (inventory / "plans" / f"{box}.json").write_text(result.model_dump_json())


def _certified(inventory: Path, box: str = "box1", passed: bool = True, seal_record: Any = None) -> Path:
    report = {"box": box, "address": "192.0.2.7", "passed": passed, "generated": "2026-11-24T03:00:00+00:00",
              "certify_version": 1, "not_checked": [], "seal": seal_record,
              "checks": [{"name": "endpoint llama-x", "section": "endpoints", "passed": True, "detail": "ok"},
                         {"name": "burn-in", "section": "burn_in", "passed": passed, "detail": "d"}]}
    path = inventory / "reports" / f"{box}.certify.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))
    return path


@pytest.fixture
def no_pdf(monkeypatch):
    monkeypatch.setattr("controller.reports.certify.print_pdf", lambda html, pdf, timeout=0: "no PDF: not in a unit test")


@pytest.fixture
def published():
    """What the fake run publishes for the box (box_seal's set_stats); a test may add ``left``."""
    return {"changed": CHANGED}


@pytest.fixture
def fake_run(monkeypatch, published):
    """run_playbook replaced: records what it was handed and publishes what box_seal would."""
    calls: list[dict[str, Any]] = []

    def run(playbook: str, **kwargs: Any) -> RunResult:
        calls.append({"playbook": playbook, **kwargs})
        return RunResult(playbook=playbook, status="successful", rc=0, elapsed=1.0,
                         data={"box_seal": {kwargs["limit"]: published}})

    monkeypatch.setattr("controller.stages.runner.run_playbook", run)
    return calls


def test_a_box_never_certified_or_failed_is_refused_with_what_to_run(tmp_path):
    fleet = load_fleet(_fleet(tmp_path))
    with pytest.raises(SealRefused, match="no certification report; run `controller certify box1 --fleet F` first"):
        check_certified(fleet.box("box1"), None, "controller certify box1 --fleet F")
    failed = {"passed": False, "checks": [{"name": "burn-in", "passed": False}, {"name": "identity", "passed": True}]}
    with pytest.raises(SealRefused, match=r"failed its last certification \(burn-in\).*`controller certify box1"):
        check_certified(fleet.box("box1"), failed, "controller certify box1 --fleet F")
    assert SealRefused.exit_code == 10


def test_windows_and_gateway_boxes_are_refused_before_any_connection(tmp_path):
    (tmp_path / "gw.key").write_text("g" * 20)
    fleet = load_fleet(_fleet(tmp_path, gateway={"api_key": {"file": str(tmp_path / "gw.key")}}))
    with pytest.raises(SealRefused, match="runs Windows"):
        check_sealable(fleet.box("win"))
    with pytest.raises(SealRefused, match="runs a gateway"):
        check_sealable(fleet.box("box1"))


def test_new_keys_are_random_one_per_server_and_keep_the_servers_key_rule():
    plan = plan_models([WantedModel(id=MODEL)], profile(CPU_ONLY), catalog())
    first, second = new_keys(plan), new_keys(plan)
    assert set(first) == {service.name for service in plan.services}
    assert first != second
    assert all(API_KEY_RULE.fullmatch(key) and len(key) >= 40 for key in first.values())


def test_what_changed_comes_from_the_roles_stats_for_that_box():
    data = {"box_seal": {"box1": {"changed": CHANGED}, "box2": {"changed": ["other"]}}}
    assert changes(data, "box1") == CHANGED
    assert changes({}, "box1") == []
    assert sealed_at({"seal": {"sealed_at": "T", "changed": []}}) == "T" and sealed_at({"seal": None}) is None


def test_buyer_keys_must_be_public_key_lines(tmp_path):
    with pytest.raises(FleetError, match="is not an SSH public key line"):
        load_fleet(_fleet(tmp_path, seal={"buyer_authorized_keys": ["-----BEGIN OPENSSH PRIVATE KEY-----"]}))
    fleet = load_fleet(_fleet(tmp_path, seal={"buyer_authorized_keys": [BUYER_KEY + "\n"]}))
    assert fleet.box("box1").seal.buyer_authorized_keys == [BUYER_KEY]


def test_seal_hands_the_keys_in_as_secrets_and_writes_them_only_into_the_buyers_copy(tmp_path, fake_run, no_pdf):
    fleet_path = _fleet(tmp_path, seal={"buyer_authorized_keys": [BUYER_KEY]})
    inventory, buyer = tmp_path / "inventory", tmp_path / "buyer"
    _plan(inventory)
    _certified(inventory)

    answer = seal(load_fleet(fleet_path), fleet_path, "box1", inventory, buyer)

    (call,) = fake_run
    assert call["playbook"] == "seal.yml" and call["limit"] == "box1"
    keys = call["secrets"]["box_seal_api_keys"]
    assert keys and all(API_KEY_RULE.fullmatch(key) for key in keys.values())
    assert call["extravars"]["box_seal_buyer_authorized_keys"] == [BUYER_KEY]
    assert not any(key in json.dumps(call["extravars"]) for key in keys.values())
    assert answer["sealed"] is True and answer["already"] is False and answer["changed"] == CHANGED

    report = json.loads((inventory / "reports" / "box1.certify.json").read_text())
    assert report["seal"] == {"sealed_at": answer["sealed_at"], "changed": CHANGED}
    assert answer["reports"]["json"] == str((inventory / "reports" / "box1.certify.json").resolve())
    for path in [*inventory.rglob("*"), fleet_path]:  # the builder's reports, the plan, the fleet: no key
        if path.is_file():
            assert not any(key in path.read_text(errors="replace") for key in keys.values()), path
    assert sorted(Path(path).name for path in answer["buyer_report"].values()) == ["box1.buyer.html", "box1.buyer.md"]
    for path in map(Path, answer["buyer_report"].values()):
        assert path.parent == buyer.resolve() and stat.S_IMODE(path.stat().st_mode) == 0o600
        assert all(key in path.read_text() for key in keys.values())
    assert stat.S_IMODE(buyer.stat().st_mode) == 0o700


def test_a_sealed_box_is_answered_from_its_report_without_a_run(tmp_path, fake_run):
    fleet_path = _fleet(tmp_path)
    inventory = tmp_path / "inventory"
    _certified(inventory, seal_record={"sealed_at": "2026-11-24T03:30:00+00:00", "changed": CHANGED})
    answer = seal(load_fleet(fleet_path), fleet_path, "box1", inventory, tmp_path / "buyer")
    assert fake_run == []
    assert answer["already"] is True and answer["sealed_at"] == "2026-11-24T03:30:00+00:00"
    assert answer["changed"] == CHANGED and answer["buyer_report"] is None
    assert not (tmp_path / "buyer").exists()


def test_refusals_come_before_any_run(tmp_path, fake_run):
    fleet_path = _fleet(tmp_path)
    inventory = tmp_path / "inventory"
    fleet = load_fleet(fleet_path)
    with pytest.raises(SealRefused, match="no certification report"):
        seal(fleet, fleet_path, "box1", inventory, tmp_path / "buyer")
    _certified(inventory, passed=False)
    with pytest.raises(SealRefused, match=r"failed its last certification \(burn-in\)"):
        seal(fleet, fleet_path, "box1", inventory, tmp_path / "buyer")
    _certified(inventory)  # certified, but this inventory has no plan for it: the one "never rendered" error
    with pytest.raises(NotRendered, match="has no plan for box1"):
        seal(fleet, fleet_path, "box1", inventory, tmp_path / "buyer")
    _certified(inventory, box="win")
    with pytest.raises(SealRefused, match="runs Windows"):
        seal(fleet, fleet_path, "win", inventory, tmp_path / "buyer")
    assert fake_run == []


def test_the_command_refuses_an_uncertified_box_in_one_line(tmp_path):
    fleet_path = _fleet(tmp_path)
    done = run_controller("seal", "box1", "--fleet", str(fleet_path), timeout=60)
    assert_one_line_error(done, 10, "box1", f"controller certify box1 --fleet {fleet_path}")
    missing = run_controller("seal", "nosuch", "--fleet", str(fleet_path), timeout=60)
    assert_one_line_error(missing, 2, "nosuch")


def test_a_buyer_account_needs_the_buyers_keys_and_sudo_needs_the_account(tmp_path):
    fleet = load_fleet(_fleet(tmp_path, seal={"buyer_authorized_keys": [BUYER_KEY], "buyer_account": "owner",
                                              "buyer_sudo": True}))
    assert fleet.box("box1").seal.buyer_account == "owner" and fleet.box("box1").seal.buyer_sudo is True
    for settings, words in (({"buyer_account": "owner"}, "needs buyer_authorized_keys"),
                            ({"buyer_authorized_keys": [BUYER_KEY], "buyer_account": "root"}, "root is always left"),
                            ({"buyer_authorized_keys": [BUYER_KEY], "buyer_sudo": True}, "buyer_sudo needs buyer_account"),
                            ({"buyer_authorized_keys": [BUYER_KEY], "buyer_account": "Bad Name"}, "buyer_account")):
        with pytest.raises(FleetError, match=words):
            load_fleet(_fleet(tmp_path, seal=settings))


def test_seal_needs_neither_hf_token_nor_api_key_and_hands_over_the_buyer_account(tmp_path, fake_run, no_pdf,
                                                                                    monkeypatch):
    """The seal makes its own keys and downloads nothing: secrets it never uses need not be set (issue 19, 5)."""
    monkeypatch.delenv("V100BOX_TEST_UNSET_HF_TOKEN", raising=False)
    monkeypatch.delenv("V100BOX_TEST_UNSET_API_KEY", raising=False)
    fleet_path = _fleet(tmp_path, hf_token={"env": "V100BOX_TEST_UNSET_HF_TOKEN"},
                        api_key={"env": "V100BOX_TEST_UNSET_API_KEY"},
                        seal={"buyer_authorized_keys": [BUYER_KEY], "buyer_account": "owner", "buyer_sudo": True})
    inventory = tmp_path / "inventory"
    _plan(inventory)
    _certified(inventory)

    answer = seal(load_fleet(fleet_path), fleet_path, "box1", inventory, tmp_path / "buyer")

    (call,) = fake_run
    assert set(call["secrets"]) == {"box_seal_api_keys"}
    assert call["extravars"]["box_seal_buyer_account"] == "owner" and call["extravars"]["box_seal_buyer_sudo"] is True
    assert answer["sealed"] is True


def test_what_the_last_step_could_not_do_fails_the_seal_after_it_is_recorded(tmp_path, fake_run, no_pdf, published):
    published["left"] = ["remove the account builder: userdel says no"]
    fleet_path = _fleet(tmp_path)
    inventory, buyer = tmp_path / "inventory", tmp_path / "buyer"
    _plan(inventory)
    _certified(inventory)
    with pytest.raises(RunError, match=r"box box1 was sealed at .*but its last step could not remove the account "
                                       r"builder: userdel says no: do that at the box's console"):
        seal(load_fleet(fleet_path), fleet_path, "box1", inventory, buyer)
    report = json.loads((inventory / "reports" / "box1.certify.json").read_text())
    assert report["seal"]["left"] == published["left"] and report["seal"]["changed"] == CHANGED
    assert (buyer / "box1.buyer.md").is_file()  # the new keys are not lost


def _sealed_inventory(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "api.key").write_text(OLD_KEY + "\n")
    fleet_path = _fleet(tmp_path, api_key={"file": str(tmp_path / "api.key")})
    inventory = tmp_path / "inventory"
    _plan(inventory)
    _certified(inventory, seal_record={"sealed_at": "2026-11-24T03:30:00+00:00", "changed": CHANGED})
    return fleet_path, inventory


OLD_KEY = "the-builders-revoked-key-0123456789"


def test_clients_says_a_sealed_box_was_handed_over_and_prints_no_key(tmp_path):
    fleet_path, inventory = _sealed_inventory(tmp_path)
    done = invoke("clients", "box1", "--fleet", str(fleet_path))
    assert done.exit_code == BoxSealed.exit_code == 10, done.output
    assert OLD_KEY not in done.output and "Traceback" not in done.output
    (line,) = [line for line in done.stderr.splitlines() if line.strip()]
    assert "box box1 was sealed at 2026-11-24T03:30:00+00:00 and handed over to its buyer" in line
    assert "no key to print" in line
    unsealed = tmp_path / "unsealed"
    unsealed.mkdir()
    fleet_path = _fleet(unsealed, api_key={"file": str(tmp_path / "api.key")})
    _plan(unsealed / "inventory")
    assert OLD_KEY in invoke("clients", "box1", "--fleet", str(fleet_path)).stdout  # an unsealed box: its key


def test_status_names_a_sealed_box_as_handed_over_without_connecting(tmp_path, monkeypatch):
    fleet_path, inventory = _sealed_inventory(tmp_path)
    runs: list[str] = []
    monkeypatch.setattr("controller.stages.verify.status.run_playbook", lambda playbook, **kwargs: runs.append(playbook))
    done = invoke("status", "box1", "--fleet", str(fleet_path))
    assert runs == [] and "Permission denied" not in done.output
    assert done.stdout.strip() == ("box1: sealed at 2026-11-24T03:30:00+00:00 and handed over to its buyer: the "
                                   "builder's SSH keys no longer open it, so status does not read it")
    assert done.exit_code == 0, done.output  # handed over: not the builder's to watch, not a failure
    answer = json.loads(invoke("status", "box1", "--fleet", str(fleet_path), "--json").stdout)
    (box,) = answer["boxes"]
    assert box["sealed"] == "2026-11-24T03:30:00+00:00" and box["reachable"] is False and answer["exit_code"] == 0
