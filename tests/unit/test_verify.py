"""controller.stages.verify: run the checks on a rendered box, and the verdict from what they answered.

The run tests check a real CPU llama-server through playbooks/verify.yml (local connection); the verdict
tests start from the answer such a run recorded (RECORDED) and change one thing at a time.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml

from controller.errors import RunError
from controller.model.fleet import Fleet, parse_fleet
from controller.model.serveplan import ServePlan, Service
from controller.stages.runner import RunResult
from controller.stages.verify import NotRendered, expects_key, results, run_verify, verdict
from lab import tinymodels
from lab.llama_server import serve

KEY = "verify-key-0123456789abcdef"

# What llama_verify published for box1 (set_stats key llama_verify) when run_verify checked the tiny model
# on the CPU llama-server with a key (test_a_rendered_box_is_checked_and_its_answers_recorded); the tiny
# model's random text is left out.
RECORDED = {
    "llama-tiny": {
        "model": "tiny", "port": 36501, "health": "ok", "served_ids": ["tiny"],
        "openai": {"object": "chat.completion", "completion_tokens": 16, "tokens_per_second": 2839.83, "text": ""},
        "anthropic": {"type": "message", "output_tokens": 16, "stop_reason": "max_tokens", "text": ""},
        "auth": {"required": True, "anonymous_status": 401, "wrong_key_status": 401},
    },
}
NCCL = {"library": "libnccl.so.2", "version": "2.27.3", "code": 22703}


def service(name: str = "llama-tiny", model: str = "tiny", **fields) -> Service:
    return Service(name=name, model=model, model_file=f"{model}.gguf", engine="upstream-02182fc", ctx=1024,
                   port=36501, **fields)


def plan_of(*services: Service) -> ServePlan:
    return ServePlan(fits=True, services=list(services))


def fleet_of(tmp_path: Path, **box) -> Fleet:
    return parse_fleet({"boxes": {"box1": {"address": "127.0.0.1", **box}}}, tmp_path / "fleet.yml")


def run_with(answers: dict, box: str = "box1", status: str = "successful", playbook: str = "site.yml") -> RunResult:
    return RunResult(playbook=playbook, status=status, rc=0, elapsed=1.0, data={"llama_verify": {box: answers}})


# The verdict, from recorded answers


def test_a_box_whose_servers_answered_as_planned_is_verified(tmp_path):
    run = run_with(copy.deepcopy(RECORDED))
    answers = results(run, fleet_of(tmp_path).box("box1"))
    outcome = verdict(plan_of(service()), answers, run, key_required=True)
    assert outcome.verified and outcome.service("llama-tiny").verified and outcome.all_problems() == []


def test_one_failing_server_fails_the_box_and_says_why(tmp_path):
    answers = copy.deepcopy(RECORDED)
    answers["llama-other"] = dict(copy.deepcopy(RECORDED["llama-tiny"]), served_ids=["tiny"])
    answers["llama-other"]["anthropic"]["type"] = "error"
    outcome = verdict(plan_of(service(), service("llama-other", "other")), answers, run_with(answers))
    assert not outcome.verified
    assert outcome.service("llama-tiny").verified
    assert outcome.service("llama-other").problems == (
        "serves ['tiny'], not other", "the Anthropic API answered 'error', not a message")


def test_a_planned_server_with_no_answer_is_not_verified():
    outcome = verdict(plan_of(service(), service("llama-late", "late")), RECORDED, run_with(RECORDED))
    assert not outcome.verified
    assert outcome.all_problems() == ["llama-late: no answer recorded: the checks did not run to the end"]


@pytest.mark.parametrize("field", ["anonymous_status", "wrong_key_status"])
def test_a_server_that_does_not_refuse_without_the_right_key_is_not_verified(field):
    answers = copy.deepcopy(RECORDED)
    answers["llama-tiny"]["auth"][field] = 200
    outcome = verdict(plan_of(service()), answers, run_with(answers))
    assert not outcome.verified
    (problem,) = outcome.service("llama-tiny").problems
    assert "answered HTTP 200" in problem and "not 401" in problem


def test_a_box_that_must_have_a_key_is_not_verified_by_a_check_without_one(tmp_path):
    answers = copy.deepcopy(RECORDED)
    answers["llama-tiny"]["auth"] = {"required": False}
    assert verdict(plan_of(service()), answers, run_with(answers)).verified  # loopback, no key asked for
    outcome = verdict(plan_of(service()), answers, run_with(answers), key_required=True)
    assert outcome.service("llama-tiny").problems == ("checked without an API key, but the box's servers must "
                                                       "require one",)
    assert expects_key(fleet_of(tmp_path, api_key={"env": "K"}).box("box1"))
    assert expects_key(fleet_of(tmp_path, bind="0.0.0.0", allow_from=["10.0.0.0/8"]).box("box1"))
    assert not expects_key(fleet_of(tmp_path).box("box1"))


def test_a_plan_that_all_reduces_through_nccl_needs_nccl_seen_to_load():
    plan = plan_of(service(nccl=True, split_mode="tensor", gpus=[0, 1]))
    without = verdict(plan, RECORDED, run_with(RECORDED))
    assert not without.verified and without.problems == (
        "the plan all-reduces through NCCL, but NCCL was not seen to load",)
    answers = {**copy.deepcopy(RECORDED), "nccl": NCCL}
    assert verdict(plan, answers, run_with(answers)).verified
    assert verdict(plan_of(service()), answers, run_with(answers)).verified  # "nccl" is not a server


def test_an_interrupted_or_missing_run_verifies_nothing():
    interrupted = verdict(plan_of(service()), RECORDED, run_with(RECORDED, status="interrupted"))
    assert not interrupted.verified and interrupted.problems == ("site.yml interrupted",)
    assert verdict(plan_of(service()), {}, None).problems == ("the checks have not run",)
    assert not verdict(plan_of(), {}, run_with({})).verified


def test_a_windows_box_reads_the_same_key_and_fields(tmp_path):
    fleet = parse_fleet({"boxes": {"win1": {"address": "192.0.2.7", "os": "windows", "transport": "winrm"}}},
                        tmp_path / "fleet.yml")
    run = run_with(copy.deepcopy(RECORDED), box="win1")
    answers = results(run, fleet.box("win1"))
    assert answers == RECORDED
    assert verdict(plan_of(service()), answers, run).verified
    assert results(RunResult(playbook="site.yml", status="successful", rc=0, elapsed=1.0,
                             data={"win_llama_verify": {"win1": RECORDED}}), fleet.box("win1")) == {}


# Running the checks


def rendered_inventory(folder: Path, port: int) -> Path:
    """The inventory render writes for a box, cut to what verify.yml reads, reached over a local connection."""
    (folder / "host_vars").mkdir(parents=True)
    (folder / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {"linux": {"hosts": {"box1": None}}}}}))
    (folder / "host_vars" / "box1.yml").write_text(yaml.safe_dump({
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
        "llama_service_bind": "127.0.0.1",
        "llama_service_instances": [{"name": "llama-tiny", "model": "tiny", "port": port}]}))
    return folder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return tinymodels.write_model(tmp_path_factory.mktemp("m") / "tiny.gguf", "llama", file_type="q8_0")


@pytest.mark.engine
@pytest.mark.slow
def test_a_rendered_box_is_checked_and_its_answers_recorded(llama_server, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("VERIFY_TEST_KEY", KEY)
    fleet = fleet_of(tmp_path, api_key={"env": "VERIFY_TEST_KEY"})
    events = []
    with serve(llama_server, tiny_model, ["--alias", "tiny", "--api-key", KEY, "-c", "1024", "-np", "1"]) as server:
        section, run = run_verify(fleet, "box1", rendered_inventory(tmp_path / "inv", server.port), events.append)
    assert run.playbook == "verify.yml" and run.status == "successful" and events
    assert set(section) == {"llama-tiny"}
    checked = section["llama-tiny"]
    assert set(checked) == set(RECORDED["llama-tiny"])  # the shape `controller verify` prints
    assert checked["served_ids"] == ["tiny"] and checked["port"] == server.port
    assert checked["auth"] == {"required": True, "anonymous_status": 401, "wrong_key_status": 401}
    assert verdict(plan_of(service()), section, run, key_required=True).verified


@pytest.mark.engine
@pytest.mark.slow
def test_a_server_that_ignores_the_key_fails_the_run(llama_server, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("VERIFY_TEST_KEY", KEY)
    fleet = fleet_of(tmp_path, api_key={"env": "VERIFY_TEST_KEY"})
    with serve(llama_server, tiny_model, ["--alias", "tiny", "-c", "1024", "-np", "1"]) as server, \
            pytest.raises(RunError, match=r"answered HTTP 200 without a key, not 401") as failed:
        run_verify(fleet, "box1", rendered_inventory(tmp_path / "inv", server.port))
    assert failed.value.exit_code == 5 and KEY not in str(failed.value)


def test_a_box_without_rendered_inventory_is_one_clear_line(tmp_path):
    with pytest.raises(NotRendered) as refused:
        run_verify(fleet_of(tmp_path), "box1", tmp_path / "inv")
    assert str(refused.value) == (f"{tmp_path / 'inv'} has no rendered inventory for box1; run "
                                  "`controller render box1` first")
    assert refused.value.exit_code == 1  # what `controller verify` has always exited with here
