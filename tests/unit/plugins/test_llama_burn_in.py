"""llama_burn_in's pure parts: nvidia-smi's sample rows, the throttle bitmask, unit counters and the problem
sentences a certify report shows; and the options it refuses (the module run as Ansible runs it)."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.unit.plugins.loader import load_module
from tests.unit.plugins.loader import run_module as run

burn = load_module("llama_burn_in")


def run_module(tmp_path: Path, **args) -> dict:
    return run("llama_burn_in", tmp_path, args, timeout=60)[1]


def test_the_query_is_the_one_the_stand_in_and_the_guard_answer():
    assert burn.SAMPLE_QUERY == ("index,uuid,temperature.gpu,temperature.memory,power.draw,power.limit,clocks.sm,"
                                 "clocks.mem,clocks_throttle_reasons.active")


def test_throttle_bits_decode_to_nvml_reasons():
    assert burn.decode_throttle("0x0000000000000000") == []
    assert burn.decode_throttle("0x0000000000000001") == ["gpu_idle"]
    assert burn.decode_throttle("0x0000000000000020") == ["sw_thermal"]
    assert burn.decode_throttle("0x00000000000000CC") == ["sw_power_cap", "hw_slowdown", "hw_thermal",
                                                          "hw_power_brake"]
    assert burn.decode_throttle("0x0000000000000112") == ["applications_clocks_setting", "sync_boost",
                                                          "display_clocks_setting"]
    assert burn.decode_throttle("0x1000") == ["unknown_0x1000"]
    assert burn.decode_throttle("[N/A]") is None
    # an idle card, application clocks, sync boost and display clocks are settings, not throttling
    assert burn.throttling(burn.decode_throttle("0x113")) == []
    assert burn.throttling(burn.decode_throttle("0x1024")) == ["sw_power_cap", "sw_thermal", "unknown_0x1000"]
    assert burn.throttling(None) == []


def test_sample_rows_read_with_na_as_null():
    text = ("0, GPU-1b7e7b3c-7d4e-4d2c-9d0e-000000000000, 83, 88, 248.51, 250.00, 1245, 877, 0x0000000000000020\n"
            "1, GPU-2c8f8c4d-8e5f-5e3d-ae1f-111111111111, 41, [N/A], [N/A], 250.00, 135, 877, 0x0000000000000001\n"
            "\n")
    hot, idle = burn.parse_sample(text)
    assert hot == {"index": 0, "temp_c": 83, "memory_temp_c": 88, "power_w": 248.51, "power_limit_w": 250,
                   "sm_clock_mhz": 1245, "mem_clock_mhz": 877, "throttle": ["sw_thermal"]}
    assert idle["memory_temp_c"] is None and idle["power_w"] is None and idle["throttle"] == []
    assert burn.parse_sample("N/A, x\n") == []
    assert burn.parse_sample("0, GPU-x, N/A, N/A, N/A, N/A, N/A, N/A, [N/A]\n")[0]["throttle"] == []


def test_unit_counters_and_generation_rate():
    assert burn.parse_show("NRestarts=3\nInvocationID=5e0b1f7d2a5c4b8e9f0a1b2c3d4e5f60\n") == (
        3, "5e0b1f7d2a5c4b8e9f0a1b2c3d4e5f60")
    assert burn.parse_show("InvocationID=\nNRestarts=0\n") == (0, "")
    assert burn.parse_show("") == (None, "")
    assert burn.generation_rate(65, 10.0, 10.64) == 100.0  # 64 tokens after the first in 0.64 s
    assert burn.generation_rate(1, 10.0, 10.0) is None and burn.generation_rate(5, None, None) is None


def _samples(rows: list[tuple[float, int, list[str]]]) -> list[dict]:
    return [{"t": t, "gpus": [{"index": 0, "temp_c": temp, "memory_temp_c": temp + 4, "power_w": 99.0,
                               "power_limit_w": 100, "sm_clock_mhz": 1200, "mem_clock_mhz": 877,
                               "throttle": throttle}]} for t, temp, throttle in rows]


def test_problem_sentences():
    samples = _samples([(0, 70, []), (5, 84, ["sw_thermal"]), (10, 86, ["sw_power_cap", "sw_thermal"]),
                        (15, 80, [])])
    assert burn.throttle_problems(samples) == [
        "GPU 0 throttled (sw_thermal, sw_power_cap) in 2 of 4 samples; hottest 86 °C (memory 90 °C)."]
    assert burn.throttle_problems(samples, ["sw_power_cap"]) == [
        "GPU 0 throttled (sw_thermal) in 2 of 4 samples; hottest 86 °C (memory 90 °C)."]
    assert burn.throttle_problems(_samples([(0, 60, ["sw_power_cap"])]), ["sw_power_cap"]) == []
    assert burn.boot_problem({"before": "a", "after": "b"}) == [
        "The box rebooted: its boot id changed from a to b."]
    assert burn.boot_problem({"before": "a", "after": "a"}) == burn.boot_problem({"before": None, "after": "a"}) == []
    assert burn.restart_problems({
        "llama-a": {"before": 0, "after": 2, "invocation_changed": True},
        "llama-b": {"before": 0, "after": 0, "invocation_changed": True},
        "llama-c": {"before": 1, "after": 1, "invocation_changed": False},
    }) == ["Service llama-a restarted during the burn-in (NRestarts 0 to 2).",
           "Service llama-b was stopped or started again during the burn-in (its systemd invocation changed)."]
    assert burn.request_problems({
        "llama-a": {"ok": 9, "errors": 1, "messages": ["/v1/messages: HTTP 503: Loading model"]},
        "llama-b": {"ok": 4, "errors": 0, "messages": []},
        "llama-c": {"ok": 0, "errors": 0, "messages": []},
    }) == ["Service llama-a failed 1 of 10 requests (first: /v1/messages: HTTP 503: Loading model).",
           "Service llama-c finished no request during the burn-in."]
    result = burn.empty_result(["llama-b"])
    result["requests"]["llama-b"]["ok"] = 1
    assert burn.all_problems(result, smi_failures=["exit 9: no device"], smi_attempts=3) == [
        "nvidia-smi failed in 1 of 3 samples (exit 9: no device)."]


def test_the_empty_result_has_every_field_of_the_contract():
    assert burn.empty_result(["llama-a"]) == {
        "duration_s": 0.0, "samples": [], "series": {"llama-a": []},
        "requests": {"llama-a": {"ok": 0, "errors": 0, "messages": []}},
        "boot_id": {"before": None, "after": None},
        "restarts": {"llama-a": {"before": None, "after": None, "invocation_changed": False}},
        "problems": [], "gpu_sampled": False}


def test_the_documentation_reads_and_returns_what_the_module_returns():
    documented = yaml.safe_load(burn.RETURN)
    assert set(documented) == set(burn.empty_result([]))
    options = yaml.safe_load(burn.DOCUMENTATION)["options"]
    assert options["tolerated_throttle"]["choices"] == list(burn.THROTTLING)


def test_no_nvidia_smi_is_no_samples_and_no_problem():
    run = burn.BurnIn([], 0.3, 2, 8, 0.1, 5, smi=None)
    result = run.run()
    assert result["gpu_sampled"] is False and result["samples"] == [] and run.smi_attempts == 0
    assert 0.3 <= result["duration_s"] < 2
    assert burn.all_problems(result, (), run.smi_failures, run.smi_attempts) == []


def test_bad_options_are_refused_with_what_to_give(tmp_path):
    service = {"name": "llama-a", "port": 9, "model": "tiny"}
    for args, message in (
        ({"duration_s": 0}, "duration_s is 0.0: give the burn-in's length in seconds, above 0"),
        ({"duration_s": 5, "concurrency": 9}, "concurrency is 9: give 1 to 8 requests per service"),
        ({"duration_s": 5, "sample_interval_s": 0}, "sample_interval_s is 0.0: give a number above 0"),
        ({"duration_s": 5, "services": [service, service]}, "service llama-a is listed twice"),
        ({"duration_s": 5, "services": [{"name": "llama-b", "model": "tiny"}]},
         "service llama-b has neither port nor base_url"),
    ):
        answer = run_module(tmp_path, **args)
        assert answer.get("failed") and message in answer["msg"], answer


def test_check_mode_sends_nothing(tmp_path):
    answer = run_module(tmp_path, duration_s=30, services=[{"name": "llama-a", "port": 9, "model": "tiny"}],
                        _ansible_check_mode=True)
    assert not answer.get("failed") and answer["changed"] is False, answer
    assert answer["requests"] == {"llama-a": {"ok": 0, "errors": 0, "messages": []}} and answer["samples"] == []
