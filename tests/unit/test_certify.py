"""controller certify's pure parts: the burn-in duration, which throughput band applies, and the checks made from
what the certification play answered (a throughput below its band fails with its likely causes; what was not
checked is said, never passed silently)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from controller.actions.certify import parse_duration
from controller.errors import FleetError
from controller.model.catalog import ThroughputBand, load_catalog
from controller.model.fleet import parse_fleet
from controller.model.profile import Driver, Gpu, HardwareProfile
from controller.stages.runner import RunResult
from controller.stages.verify.certify import band_for, evaluate, likely_causes
from tests.unit.test_verify_status import ANSWERS, plan

BOX = parse_fleet({"boxes": {"lab1": {"address": "10.0.0.5", "models": [{"id": "tiny-llama"}]}}},
                  Path("fleet.yml")).box("lab1")
CHECKED = {"health": "ok", "served_ids": ["tiny-llama"], "openai": {"object": "chat.completion"},
           "anthropic": {"type": "message"}, "auth": {"required": False},
           "tool_call": {"ok": True, "tool_use": True, "tool_name": "add", "stop_reason": "tool_use",
                         "final_stop_reason": "end_turn", "detail": ""},
           "streams": {"openai": {"ok": True, "chunks": 9, "done": True, "detail": ""},
                       "anthropic": {"ok": True, "events": 14, "message_stop": True, "detail": ""}},
           "throughput": {"prompt_tokens": 200, "prompt_per_second": 900.0, "predicted_tokens": 64,
                          "predicted_per_second": 50.0, "detail": ""}}
V100 = HardwareProfile(gpus=[Gpu(index=0, name="Tesla V100-SXM2-16GB", memory_mib=16384)],
                       driver=Driver(version="580.82.07"))


class _Catalog:
    """The built-in catalog with one band for the test model."""

    def __init__(self, bands: list[ThroughputBand]):
        self.bands = bands

    def model(self, _model_id: str) -> Any:
        return type("Entry", (), {"throughput": self.bands, "tool_calls": True})()


def band(**fields: Any) -> ThroughputBand:
    return ThroughputBand(**{"hardware": "one V100", "gpus": 1, "gen_tok_s": (40, None), "source": "test",
                             **fields})


def run(status: str = "successful") -> RunResult:
    return RunResult(playbook="certify.yml", status=status, rc=0, elapsed=1.0)


@pytest.mark.parametrize(("text", "seconds"), [("25m", 1500), ("1h30m", 5400), ("90s", 90), ("600", 600),
                                                ("2h", 7200)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "five minutes", "25x", "-5m", "0", "0s", "1.5h", "m", "9999h"])
def test_a_duration_that_is_not_one_is_refused_with_the_forms_it_takes(text):
    with pytest.raises(FleetError, match="--burn-in"):
        parse_duration(text)


def test_the_band_follows_cards_offload_and_driver_mode():
    service = plan().services[0]
    tcc, mcdm, linux = band(driver_model="TCC"), band(driver_model="MCDM"), band()
    assert band_for(service, V100, [mcdm, tcc]) is tcc  # Linux reports no driver model: native, like TCC
    mcdm_box = V100.model_copy(update={"driver": Driver(version="581.57", model="MCDM")})
    assert band_for(service, mcdm_box, [tcc, mcdm, linux]) is mcdm
    assert band_for(service, V100, [band(offload=True), band(gpus=2)]) is None


def test_the_built_in_catalog_carries_the_kits_bands_with_their_sources():
    catalog = load_catalog()
    gemma = catalog.model("gemma4-26b-a4b-qat-q4_0").throughput
    assert [b.reference_gen_tok_s for b in gemma if b.driver_model in ("TCC", "MCDM")] == [99.8, 56.8]
    assert all(b.source and b.gen_tok_s[0] < (b.reference_gen_tok_s or 0) for b in gemma)
    (split,) = catalog.model("qwen3.6-35b-a3b-q6_k").throughput
    assert (split.gpus, split.split, split.reference_gen_tok_s) == (2, "layer", 82.8)


def found(verify: dict, extras: dict | None = None, bands: list | None = None, **kwargs: Any) -> dict:
    return evaluate(BOX, plan(), V100, _Catalog(bands if bands is not None else [band()]), run(), verify,
                    copy.deepcopy(ANSWERS), extras or {}, fleet_path="fleet.yml", locked=None,
                    engine_root="/opt/llama", burn_in_s=kwargs.get("burn_in_s", 0),
                    thermal=kwargs.get("thermal"), power_planned=kwargs.get("power_planned", False))


def checks(result: dict) -> dict[str, dict]:
    return {item["name"]: item for item in result["checks"]}


def test_a_healthy_box_passes_every_check_and_says_what_it_did_not_check():
    result = found({"llama-tiny-llama": CHECKED})
    assert all(item["passed"] for item in result["checks"]), result["checks"]
    assert set(checks(result)) == {"identity", "installed as planned", "endpoint llama-tiny-llama",
                                   "throughput llama-tiny-llama"}
    assert {item["name"] for item in result["not_checked"]} == {"burn-in", "thermal guard", "power limits",
                                                                "GPU memory vs plan"}  # the play read no processes


def test_throughput_below_the_band_fails_with_the_causes_seen():
    burn_in = {"samples": [{"t": 0, "gpus": [{"index": 0, "temp_c": 88, "throttle": ["sw_thermal", "gpu_idle"]}]}],
               "requests": {"llama-tiny-llama": {"ok": 3, "errors": 0}}, "problems": [], "gpu_sampled": True,
               "duration_s": 5}
    result = found({"llama-tiny-llama": CHECKED}, {"burn_in": burn_in}, [band(gen_tok_s=(80, None))], burn_in_s=5)
    failed = checks(result)["throughput llama-tiny-llama"]
    assert not failed["passed"]
    assert "50.0 tok/s is below the band's 80" in failed["detail"] and "thermal throttling: sw_thermal" in failed["detail"]
    assert checks(result)["burn-in"]["passed"]


def test_the_usual_causes_when_nothing_was_seen():
    assert "MCDM instead of TCC" in likely_causes(plan().services[0], V100, None, None)[0]


def test_an_endpoint_without_a_tool_call_or_a_stream_fails():
    broken = {**CHECKED, "tool_call": {"ok": False, "detail": "no tool_use block: stop_reason end_turn"},
              "streams": {"openai": {"ok": True}, "anthropic": {"ok": False, "detail": "no message_stop event"}}}
    detail = checks(found({"llama-tiny-llama": broken}))["endpoint llama-tiny-llama"]["detail"]
    assert "no tool_use block" in detail and "streaming on the anthropic API: no message_stop event" in detail


def test_no_band_is_not_checked_with_the_rate_measured():
    result = found({"llama-tiny-llama": CHECKED}, bands=[])
    (item,) = [item for item in result["not_checked"] if item["name"].startswith("throughput")]
    assert "no throughput band" in item["why"] and "50.0 tok/s" in item["why"]


def test_burn_in_problems_a_stopped_guard_and_unapplied_power_limits_fail():
    burn_in = {"samples": [], "requests": {"llama-tiny-llama": {"ok": 4, "errors": 1}}, "gpu_sampled": False,
               "problems": ["llama-tiny-llama restarted during the burn-in (NRestarts 0 -> 1)"], "duration_s": 5}
    extras = {"burn_in": burn_in, "units": {"v100box-thermal-guard": {"load": "loaded", "active": "failed"}},
              "guard_events": ['{"kind": "stop", "gpu": 0, "temp_c": 86}', "torn"],
              "power": '{"persistence": true, "limits": [{"gpu": 0, "watts": 100, "applied": false}]}'}
    result = found({"llama-tiny-llama": CHECKED}, extras, burn_in_s=5, thermal={"guard": True, "warn_c": 80,
                                                                                "stop_c": 85}, power_planned=True)
    by_name = checks(result)
    assert "restarted" in by_name["burn-in"]["detail"] and not by_name["burn-in"]["passed"]
    assert not by_name["thermal guard"]["passed"] and "failed" in by_name["thermal guard"]["detail"]
    assert not by_name["power limits"]["passed"] and "NOT applied" in by_name["power limits"]["detail"]
    assert result["thermal_guard"]["events"] == [{"kind": "stop", "gpu": 0, "temp_c": 86}]


def test_a_failed_run_fails_the_certification():
    result = evaluate(BOX, plan(), V100, _Catalog([band()]), run("failed"), {}, None, {}, fleet_path="f.yml",
                      locked=None, engine_root="/opt/llama", burn_in_s=0, thermal=None, power_planned=False)
    by_name = checks(result)
    assert not by_name["certification run"]["passed"] and not by_name["endpoint llama-tiny-llama"]["passed"]


def test_a_tool_call_not_checked_reads_as_not_checked_in_a_passing_report():
    """Issue 21: certify passed while its Endpoints section printed "Tool call round trip: FAILED: tool_use block
    no..." for a model whose template makes no tool calls (listed as not checked)."""
    from controller.reports.certify import html, markdown

    class NoTools(_Catalog):
        def model(self, _model_id: str) -> Any:
            return type("Entry", (), {"throughput": self.bands, "tool_calls": False})()

    answer = {**CHECKED, "tool_call": {"ok": False, "tool_use": False, "detail": "no tool_use block: stop_reason "
                                                                                "end_turn"}}
    result = evaluate(BOX, plan(), V100, NoTools([band()]), run(), {"llama-tiny-llama": answer},
                      copy.deepcopy(ANSWERS), {}, fleet_path="fleet.yml", locked=None, engine_root="/opt/llama",
                      burn_in_s=0, thermal=None, power_planned=False)
    assert all(item["passed"] for item in result["checks"]), result["checks"]
    report = {"box": "lab1", "passed": True, "checks": result["checks"], "not_checked": result["not_checked"],
              "endpoints": {"llama-tiny-llama": {"endpoint": "http://127.0.0.1:8001", **answer}},
              "throughput": result["throughput"]}
    text = markdown(report)
    endpoints = text[text.index("## Endpoints"):text.index("## Throughput")]
    assert "FAILED" not in endpoints and "FAIL" not in endpoints
    assert ("Tool call round trip:** not checked: the catalog says tiny-llama's chat template makes no tool calls"
            in endpoints)
    page = html(report)
    assert "FAILED" not in page[page.index('id="endpoints"'):page.index('id="throughput"')]
