"""The report keeps its JSON fields, and says verified exactly when controller.verify's verdict does."""

from __future__ import annotations

import copy

from controller.fleet import parse_fleet
from controller.report import build_report, markdown
from controller.runner import HostStats, RunResult
from tests.unit.test_verify import RECORDED, plan_of, service
from tests.unit.tiny_box import CPU_PROFILE

SERVICE_FIELDS = {"name", "model", "engine", "endpoint", "gpus", "ctx", "parallel", "verified", "health",
                  "served_ids", "openai", "anthropic", "auth", "reasons"}
REPORT_FIELDS = {"box", "address", "generated", "hardware", "run", "driver", "cache", "services", "unplaced",
                 "verified"}


def box(tmp_path, **fields):
    return parse_fleet({"boxes": {"box1": {"address": "127.0.0.1", **fields}}}, tmp_path / "fleet.yml").box("box1")


def site_run(status: str = "successful", answers=None) -> RunResult:
    return RunResult(playbook="site.yml", status=status, rc=0, elapsed=12.34, stats={"box1": HostStats(ok=9)},
                     data={"llama_verify": {"box1": answers or {}}}, last_task="box1: Start llama-tiny")


def test_a_verified_box_reports_its_fields_and_says_so(tmp_path):
    report = build_report(box(tmp_path, api_key={"env": "K"}), CPU_PROFILE, plan_of(service()),
                          site_run(answers=RECORDED), copy.deepcopy(RECORDED), 0.5)
    assert set(report) == REPORT_FIELDS and report["verified"] is True
    (entry,) = report["services"]
    assert set(entry) == SERVICE_FIELDS and entry["verified"] is True
    assert entry["auth"] == {"required": True, "anonymous_status": 401, "wrong_key_status": 401}
    assert entry["endpoint"] == "http://127.0.0.1:36501" and entry["served_ids"] == ["tiny"]
    assert report["run"]["stopped_at"] is None
    text = markdown(report)
    assert "Verified: **yes**" in text and "- API key: required; without it HTTP 401" in text


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
