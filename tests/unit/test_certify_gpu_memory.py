"""Issue 20 item 5: certify compares what each card holds once the servers are up (nvidia-smi's used memory of each
service's process) with the plan's estimate for the card, records both and fails with the numbers when a card holds
more than planned. Pure: the answers are what llama_box_state returns (its units' main PIDs, its processes)."""

from __future__ import annotations

import copy
from typing import Any

from controller.model.profile import Driver, Gpu, HardwareProfile
from controller.model.serveplan import ServePlan, Service, ServiceMemory
from controller.reports import certify as certify_report
from controller.stages.verify.certify import GPU_MEMORY, evaluate, gpu_memory
from tests.unit.test_certify import BOX, CHECKED, _Catalog, band, run
from tests.unit.test_verify_status import ANSWERS
from tests.unit.test_verify_status import plan as status_plan

UUIDS = ("GPU-0fa0c0de-1111-2222-3333-444455556666", "GPU-0fa0c0de-1111-2222-3333-777788889999")
BUSES = ("00000000:1A:00.0", "00000000:1B:00.0")
TWO_V100 = HardwareProfile(gpus=[Gpu(index=i, name="Tesla V100-SXM2-32GB", memory_mib=32768, uuid=UUIDS[i],
                                     pci_bus_id=BUSES[i]) for i in range(2)], driver=Driver(version="580.82.07"))
SERVER = "/opt/llama/upstream/current/bin/llama-server"


def service(name: str, port: int, memory: dict[str, int]) -> Service:
    gpus = sorted(int(device[4:]) for device in memory if device.startswith("cuda"))
    return Service(name=name, model="tiny-llama", model_file="tiny.gguf", engine="upstream-0c1e570", ctx=4096,
                   port=port, gpus=gpus, memory=ServiceMemory(per_device_mib=memory))


# One service on each card, and one split over both (its estimate per card).
PLAN = ServePlan(fits=True, services=[service("llama-a", 8001, {"cuda0": 14900, "cpu": 900}),
                                      service("llama-split", 8002, {"cuda0": 8000, "cuda1": 9000, "cpu": 700})])
UNITS = {"llama-a": {"active": "active", "main_pid": 4242}, "llama-split": {"active": "active", "main_pid": 4343},
         "v100box-thermal-guard": {"active": "active", "main_pid": 77}}


def process(pid: int, used: int | None, card: int, *, by: str = "uuid", name: str = SERVER) -> dict[str, Any]:
    return {"pid": pid, "used_mib": used, "gpu_uuid": UUIDS[card] if by == "uuid" else None,
            # by PCI address: as lspci spells it (4-digit domain, lower case), the profile as nvidia-smi does
            "gpu_bus_id": BUSES[card].lower()[4:] if by == "bus" else BUSES[card], "process_name": name}


def read(processes: list[dict[str, Any]], profile: HardwareProfile = TWO_V100, plan: ServePlan = PLAN, **extras: Any):
    answers = {"units": UNITS, "gpu_processes": processes, "gpu_processes_error": "", **extras}
    return gpu_memory(plan, profile, answers, windows=False)


def by_name(checks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in checks}


def test_cards_within_the_plan_pass_with_both_numbers_recorded():
    rows, checks, not_checked = read([process(4242, 14100, 0), process(4343, 7600, 0), process(4343, 8800, 1)])
    assert not_checked == []
    first, second = by_name(checks)["GPU 0 memory vs plan"], by_name(checks)["GPU 1 memory vs plan"]
    assert first["passed"] and second["passed"] and first["section"] == "gpu_memory"
    assert "holds 21700 MiB for the plan's services, within the 22900 MiB the plan estimates" in first["detail"]
    assert "llama-a holds 14100 MiB of 14900 MiB planned; llama-split holds 7600 MiB of 8000 MiB planned" in \
        first["detail"]
    assert [(row["gpu"], row["planned_mib"], row["used_mib"], row["passed"]) for row in rows] == [
        (0, 22900, 21700, True), (1, 9000, 8800, True)]
    assert rows[0]["services"][0] == {"service": "llama-a", "planned_mib": 14900, "used_mib": 14100, "pids": [4242]}


def test_a_card_holding_more_than_planned_fails_naming_the_card_the_services_and_both_numbers():
    rows, checks, _ = read([process(4242, 16000, 0), process(4343, 7600, 0), process(4343, 8800, 1)])
    failed = by_name(checks)["GPU 0 memory vs plan"]
    assert not failed["passed"] and by_name(checks)["GPU 1 memory vs plan"]["passed"]
    assert failed["detail"].startswith(f"GPU 0 (Tesla V100-SXM2-32GB, {UUIDS[0]}) holds 23600 MiB")
    assert "700 MiB more than the 22900 MiB the plan estimates" in failed["detail"]
    assert "llama-a holds 16000 MiB of 14900 MiB planned" in failed["detail"]
    assert (rows[0]["planned_mib"], rows[0]["used_mib"], rows[0]["passed"]) == (22900, 23600, False)


def test_a_process_of_no_planned_service_is_recorded_but_not_counted():
    rows, checks, _ = read([process(4242, 14000, 0), process(4343, 7000, 0), process(4343, 8000, 1),
                            process(9999, 12000, 0, name="/usr/bin/python3")])
    passed = by_name(checks)["GPU 0 memory vs plan"]
    assert passed["passed"] and "other processes hold 12000 MiB on it" in passed["detail"]
    assert (rows[0]["used_mib"], rows[0]["other_mib"]) == (21000, 12000)
    assert [item["service"] for item in rows[0]["services"]] == ["llama-a", "llama-split"]


def test_a_card_is_found_by_its_pci_address_when_nvidia_smi_names_no_uuid():
    _, checks, _ = read([process(4242, 15000, 0, by="bus"), process(4343, 8100, 0, by="bus"),
                         process(4343, 100, 1, by="bus")])
    assert not by_name(checks)["GPU 0 memory vs plan"]["passed"]
    assert by_name(checks)["GPU 1 memory vs plan"]["passed"]


def test_a_card_missing_from_the_probe_fails_and_a_planned_card_holding_nothing_says_so():
    stray = {"pid": 4242, "used_mib": 3000, "gpu_uuid": "GPU-ffffffff-0000-0000-0000-000000000000",
             "gpu_bus_id": "00000000:9F:00.0", "process_name": SERVER}
    rows, checks, _ = read([process(4242, 14000, 0), stray, process(4343, 7000, 0)])
    missing = by_name(checks)[GPU_MEMORY]
    assert not missing["passed"]
    assert "llama-a (PID 4242) holds 3000 MiB on a card the probe did not see (GPU-ffffffff" in missing["detail"]
    idle = by_name(checks)["GPU 1 memory vs plan"]
    assert idle["passed"] and "llama-split holds nothing on it" in idle["detail"]
    assert (rows[1]["planned_mib"], rows[1]["used_mib"]) == (9000, 0)


def test_a_service_holding_a_card_its_plan_keeps_off_fails():
    cpu_only = ServePlan(fits=True, services=[service("llama-a", 8001, {"cpu": 900})])
    rows, checks, _ = read([process(4242, 5000, 1)], plan=cpu_only)
    (failed,) = checks
    assert failed["name"] == "GPU 1 memory vs plan" and not failed["passed"]
    assert "holds 5000 MiB" in failed["detail"] and "than the 0 MiB the plan estimates" in failed["detail"]
    assert [(row["gpu"], row["planned_mib"], row["used_mib"]) for row in rows] == [(1, 0, 5000)]


def test_what_cannot_be_compared_is_said():
    cpu_box = HardwareProfile(gpus=[], driver=Driver())
    rows, checks, not_checked = read([], profile=cpu_box)
    assert (rows, checks) == (None, []) and not_checked == [
        {"name": GPU_MEMORY, "why": "the box has no NVIDIA GPU: every service runs on the CPU"}]
    _, _, windows = gpu_memory(PLAN, TWO_V100, {}, windows=True)
    assert windows[0]["name"] == GPU_MEMORY and "Linux" in windows[0]["why"]
    _, _, unread = gpu_memory(PLAN, TWO_V100, {}, windows=False)
    assert "did not read" in unread[0]["why"]
    _, (broken,), _ = read([], gpu_processes_error="nvidia-smi exited 9: no such query")
    assert not broken["passed"] and "nvidia-smi exited 9" in broken["detail"]
    _, checks, not_checked = read([process(4242, None, 0), process(4343, 8000, 1)])
    assert "GPU 0 memory vs plan" not in by_name(checks) and by_name(checks)["GPU 1 memory vs plan"]["passed"]
    assert not_checked == [{"name": "GPU 0 memory vs plan", "why": "nvidia-smi does not say how much llama-a holds on "
                                                                   f"GPU 0 (Tesla V100-SXM2-32GB, {UUIDS[0]})"}]


def test_a_box_that_serves_no_card_passes_when_nothing_of_the_plan_holds_one():
    cpu_only = ServePlan(fits=True, services=[service("llama-a", 8001, {"cpu": 900})])
    rows, (only,), _ = read([], plan=cpu_only)
    assert rows == [] and only["passed"] and "the plan puts no service on the box's 2 GPU(s)" in only["detail"]
    rows, (only,), _ = read([process(9999, 300, 0, name="/usr/lib/xorg/Xorg")], plan=cpu_only)
    assert only["passed"] and [(row["gpu"], row["other_mib"], row["passed"]) for row in rows] == [(0, 300, None)]


def test_certify_fails_over_plan_and_the_report_shows_both_numbers():
    profile = TWO_V100.model_copy(update={"gpus": TWO_V100.gpus[:1]})
    the_plan = status_plan()  # llama-tiny-llama, 14900 MiB on cuda0
    extras = {"units": {"llama-tiny-llama": {"main_pid": 4242}}, "gpu_processes_error": "",
              "gpu_processes": [process(4242, 15230, 0)]}
    result = evaluate(BOX, the_plan, profile, _Catalog([band()]), run(), {"llama-tiny-llama": CHECKED},
                      copy.deepcopy(ANSWERS), extras, fleet_path="fleet.yml", locked=None, engine_root="/opt/llama",
                      burn_in_s=0, thermal=None, power_planned=False)
    (failed,) = [item for item in result["checks"] if not item["passed"]]
    assert failed["name"] == "GPU 0 memory vs plan" and "330 MiB more than the 14900 MiB" in failed["detail"]
    report = {"box": "lab1", "passed": False, "checks": result["checks"], "not_checked": result["not_checked"],
              "gpu_memory": result["gpu_memory"]}
    text = certify_report.markdown(report)
    section = text[text.index("## GPU memory vs plan"):text.index("## Burn-in")]
    assert "— FAIL" in section.splitlines()[0]
    assert "| 0 | Tesla V100-SXM2-32GB | 14900 | 15230 | -330 | 0 | **FAIL** |" in section
    assert "| 0 | `llama-tiny-llama` | 14900 | 15230 | 4242 |" in section
    page = certify_report.html(report)
    shown = page[page.index('id="gpu_memory"'):page.index('id="burn_in"')]
    assert ">14900</td>" in shown and ">15230</td>" in shown and ">-330</td>" in shown and ">FAIL</td>" in shown


def test_the_report_says_why_a_cpu_box_was_not_compared():
    report = {"box": "lab1", "passed": True, "checks": [], "not_checked": [
        {"name": GPU_MEMORY, "why": "the box has no NVIDIA GPU: every service runs on the CPU"}], "gpu_memory": None}
    text = certify_report.markdown(report)
    section = text[text.index("## GPU memory vs plan"):text.index("## Burn-in")]
    assert "not checked: the box has no NVIDIA GPU" in section


def test_an_on_demand_routers_model_servers_count_for_it_by_their_unit():
    # The router (main PID 4545) holds nothing; the model server it started (PID 4546, a child) holds the card.
    router = service("llama-on-demand", 8003, {"cuda1": 15000, "cpu": 500})
    plan = ServePlan(fits=True, services=[router])
    units = {"llama-on-demand": {"active": "active", "main_pid": 4545}}
    child = {**process(4546, 14200, 1), "unit": "llama-on-demand.service"}
    rows, checks, _ = read([child], plan=plan, units=units)
    (card,) = checks
    assert card["passed"] and "llama-on-demand holds 14200 MiB of 15000 MiB planned" in card["detail"]
    assert rows[0]["services"][0]["pids"] == [4546] and rows[0]["other_mib"] == 0
