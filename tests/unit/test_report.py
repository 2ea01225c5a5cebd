"""The report keeps its JSON fields, and says verified exactly when controller.stages.verify's verdict does."""

from __future__ import annotations

import copy

from controller.model.fleet import parse_fleet
from controller.model.serveplan import Unplaced
from controller.reports.provision import build_report, markdown, not_as_asked
from controller.stages.runner import HostStats, RunResult
from tests.unit.test_verify import RECORDED, plan_of, service
from tests.unit.tiny_box import CPU_PROFILE

SERVICE_FIELDS = {"name", "model", "engine", "endpoint", "gpus", "ctx", "parallel", "verified", "health",
                  "served_ids", "openai", "anthropic", "auth", "reasons"}
REPORT_FIELDS = {"box", "address", "generated", "hardware", "run", "driver", "cache", "services", "unplaced",
                 "verified", "provisioned_as_asked", "fast_path"}


def box(tmp_path, **fields):
    return parse_fleet({"boxes": {"box1": {"address": "127.0.0.1", **fields}}}, tmp_path / "fleet.yml").box("box1")


def site_run(status: str = "successful", answers=None) -> RunResult:
    return RunResult(playbook="site.yml", status=status, rc=0, elapsed=12.34, stats={"box1": HostStats(ok=9)},
                     data={"llama_verify": {"box1": answers or {}}}, last_task="box1: Start llama-tiny")


def test_a_verified_box_reports_its_fields_and_says_so(tmp_path):
    report = build_report(box(tmp_path, api_key={"env": "K"}), CPU_PROFILE, plan_of(service()),
                          site_run(answers=RECORDED), copy.deepcopy(RECORDED), 0.5)
    assert set(report) == REPORT_FIELDS and report["verified"] is True and report["provisioned_as_asked"] is True
    (entry,) = report["services"]
    assert set(entry) == SERVICE_FIELDS and entry["verified"] is True
    assert entry["auth"] == {"required": True, "anonymous_status": 401, "wrong_key_status": 401}
    assert entry["endpoint"] == "http://127.0.0.1:36501" and entry["served_ids"] == ["tiny"]
    assert report["run"]["stopped_at"] is None and report["run"]["strategy"] == "linear"
    text = markdown(report)
    assert "Verified: **yes**" in text and "- API key: required; without it HTTP 401" in text
    assert "- site.yml: successful in 12.3 s, 0 changed, under Ansible's linear strategy" in text
    mitogen = site_run(answers=RECORDED)
    mitogen.strategy = "mitogen_linear"
    shown = markdown(build_report(box(tmp_path, api_key={"env": "K"}), CPU_PROFILE, plan_of(service()), mitogen,
                                  copy.deepcopy(RECORDED), 0.5))
    assert "0 changed, under Ansible's mitogen_linear strategy" in shown


def test_a_server_without_its_key_checked_is_reported_unverified(tmp_path):
    answers = copy.deepcopy(RECORDED)
    answers["llama-tiny"]["auth"] = {"required": False}
    report = build_report(box(tmp_path, api_key={"env": "K"}), CPU_PROFILE, plan_of(service()),
                          site_run(answers=answers), answers, 0.5)
    assert report["verified"] is False and report["services"][0]["verified"] is False
    assert "Verified: **NO**" in markdown(report)


def test_an_interrupted_run_reports_where_it_stopped_and_nothing_verified(tmp_path):
    report = build_report(box(tmp_path), CPU_PROFILE, plan_of(service()), site_run("interrupted"), {}, 0.5)
    assert report["verified"] is False and report["services"][0]["verified"] is False
    assert report["run"]["status"] == "interrupted" and report["run"]["stopped_at"] == "box1: Start llama-tiny"
    assert report["services"][0]["served_ids"] == [] and report["services"][0]["health"] is None


BIG_WHY = "on the CPU it needs 40960 MiB of RAM at 4096 tokens of context, against 7000 MiB free"


def test_a_box_that_serves_only_part_of_what_it_was_asked_is_not_provisioned_as_asked(tmp_path):
    """Issue 21: the wanted model the plan could not place was line 207 of 211, under 'Verified: yes'."""
    plan = plan_of(service())
    plan.fits, plan.unplaced = False, [Unplaced(model="qwen3.5-122b-a10b-q8_0", reason=BIG_WHY)]
    report = build_report(box(tmp_path, api_key={"env": "K"}), CPU_PROFILE, plan, site_run(answers=RECORDED),
                          copy.deepcopy(RECORDED), 0.5)
    assert report["verified"] is True  # what was placed answered as planned
    assert report["provisioned_as_asked"] is False
    assert report["unplaced"] == [{"model": "qwen3.5-122b-a10b-q8_0", "reason": BIG_WHY}]
    assert not_as_asked(report) == f"qwen3.5-122b-a10b-q8_0 was not placed: {BIG_WHY}"
    text = markdown(report)
    assert "Verified: **yes**" not in text.splitlines()[2]  # the headline says what is true of the whole box
    assert "Provisioned as asked: **NO**" in text.splitlines()[2]
    last = [line for line in text.splitlines() if line.strip()][-3:]
    assert any(line.startswith("- Not placed: qwen3.5-122b-a10b-q8_0:") and BIG_WHY in line for line in last), last


def test_a_box_that_serves_everything_it_was_asked_says_so_without_a_not_placed_section(tmp_path):
    report = build_report(box(tmp_path, api_key={"env": "K"}), CPU_PROFILE, plan_of(service()),
                          site_run(answers=RECORDED), copy.deepcopy(RECORDED), 0.5)
    assert not_as_asked(report) is None
    text = markdown(report)
    assert "Verified: **yes**." in text and "Not placed" not in text and "as asked: **NO**" not in text


def test_the_report_says_whether_the_run_was_a_full_one_and_why(tmp_path):
    """site.yml publishes its first comparison (set_stats fast_path); the report keeps it, per box."""
    def report_for(decision):
        run = site_run(answers=RECORDED)
        if decision is not None:
            run.data["fast_path"] = {"box1": decision, "other": {"converged": True, "reasons": []}}
        return build_report(box(tmp_path, api_key={"env": "K"}), CPU_PROFILE, plan_of(service()), run,
                            copy.deepcopy(RECORDED), 0.5)

    full = report_for({"converged": False, "reasons": ["/etc/llama/llama-tiny.env: mode changed"]})
    assert full["fast_path"] == {"converged": False, "reasons": ["/etc/llama/llama-tiny.env: mode changed"]}
    assert "- A full run: /etc/llama/llama-tiny.env: mode changed" in markdown(full)
    converged = report_for({"converged": True, "reasons": []})
    assert converged["fast_path"] == {"converged": True, "reasons": []}
    assert "only the servers were checked" in markdown(converged)
    # No comparison (a Windows box, a run that never started): no section, and no line.
    alone = report_for(None)
    assert alone["fast_path"] is None and "## This run" not in markdown(alone)
