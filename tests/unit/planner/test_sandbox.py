"""Issue 20: a Linux service opens its cards by their device nodes' minor numbers and names them to CUDA by UUID;
MemoryDenyWriteExecute= is on where the engine build carries machine code for the card (or is a CPU build) and off,
with the reason, where the driver would compile at start. Old profiles without minor numbers still plan, with a
warning."""

from __future__ import annotations

import pytest
import yaml

from controller.model.catalog import load_catalog
from controller.model.fleet import parse_fleet
from controller.model.profile import Gpu, OsInfo
from controller.stages.planner import plan_box
from controller.stages.planner.sandbox import deny_write_execute, device_minors
from controller.stages.render import host_vars
from tests.unit.planner.helpers import CPU_ONLY, DUAL, SINGLE, TWELVE, only, plan, profile

GEMMA, Q6K, BIG122 = "gemma4-26b-a4b-qat-q4_0", "qwen3.6-35b-a3b-q6_k", "qwen3.5-122b-a10b-q8_0"
GATE, REVIEWER = "qwen3-4b-instruct-2507-q8_0", "gemma4-31b-it-q8_0"
OLD = "epyc-4x3090-2xv100-pcie"  # probed before minor numbers were recorded: no nvidia-smi-q.txt


def _card(index: int, name: str = "Tesla V100-SXM2-32GB", cap: str | None = "7.0", **extra) -> Gpu:
    return Gpu(index=index, name=name, compute_capability=cap, **extra)


def test_the_twelve_card_box_opens_each_card_by_its_minor_number_not_its_index():
    box = profile(TWELVE)
    minor = {gpu.index: gpu.minor_number for gpu in box.gpus}
    uuid = {gpu.index: gpu.uuid for gpu in box.gpus}
    assert any(index != number for index, number in minor.items())  # the fixture's driver numbered otherwise
    result = plan(TWELVE, Q6K, BIG122, GATE, REVIEWER)
    assert result.fits
    for service in result.services:
        assert service.gpu_minors == [minor[index] for index in service.gpus]
        assert service.env["CUDA_VISIBLE_DEVICES"] == ",".join(uuid[index] for index in service.gpus)
        nodes = ", ".join(f"/dev/nvidia{minor[index]}" for index in service.gpus)
        assert any(reason.startswith(f"device nodes {nodes} (each card's minor number)") for reason in service.reasons)
        assert not any(reason.startswith("warning:") for reason in service.reasons)


def test_the_reason_names_which_cuda_device_is_which_card():
    service = only(plan(TWELVE, BIG122))
    order = ", ".join(f"CUDA{position} is GPU {index}" for position, index in enumerate(service.gpus))
    assert any("named by UUID" in reason and order in reason for reason in service.reasons)


def test_an_old_profile_without_minor_numbers_still_plans_and_says_the_index_was_assumed():
    box = profile(OLD)
    assert box.gpus and all(gpu.minor_number is None for gpu in box.gpus)
    result = plan(OLD, GEMMA)
    service = only(result)
    assert service.gpu_minors == service.gpus
    warnings = [reason for reason in service.reasons if reason.startswith("warning:")]
    assert len(warnings) == 1
    assert f"no minor number for GPU {', '.join(map(str, service.gpus))}" in warnings[0]
    assert "probe the box again" in warnings[0]


def test_cards_without_a_uuid_are_pinned_by_index_in_pci_bus_order():
    box = profile(TWELVE).model_copy(update={"gpus": [gpu.model_copy(update={"uuid": None})
                                                      for gpu in profile(TWELVE).gpus]})
    service = only(plan(box, BIG122))
    assert service.env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, service.gpus))
    assert service.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert any("no UUID" in reason and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in reason for reason in service.reasons)


def test_write_execute_memory_is_refused_for_a_v100_on_an_sm70_pack():
    service = only(plan(SINGLE, GEMMA))
    assert service.engine == "upstream-02182fc" and service.memory_deny_write_execute
    assert any(reason.startswith("MemoryDenyWriteExecute=yes: upstream-02182fc carries machine code for sm_70")
               for reason in service.reasons)


def test_write_execute_memory_is_refused_for_a_cpu_service():
    service = only(plan(CPU_ONLY, GATE))
    assert service.gpus == [] and service.gpu_minors == [] and service.memory_deny_write_execute
    assert any(reason.startswith("MemoryDenyWriteExecute=yes: a CPU build") for reason in service.reasons)


@pytest.mark.parametrize(("card", "archs", "why"), [
    (_card(0, "NVIDIA GeForce RTX 3090", "8.6"), [80], "GPU 0's sm_86 (Ampere) exactly (cuda_archs: 80)"),
    (_card(1, "Unknown card", None), [70], "GPU 1's unknown architecture"),
])
def test_write_execute_memory_stays_allowed_where_the_driver_may_compile(card, archs, why):
    engine = load_catalog().engine("upstream-02182fc").model_copy(update={"cuda_archs": archs})
    allowed, reason = deny_write_execute(engine, [card])
    assert not allowed
    assert reason.startswith("MemoryDenyWriteExecute off: upstream-02182fc carries no machine code for ") and why in reason
    assert "writable and executable" in reason


def test_device_minors_take_the_probed_number_and_guess_only_where_none_was_probed():
    minors, reasons = device_minors([_card(0, minor_number=3), _card(1)])
    assert minors == [3, 1]
    assert reasons[0].startswith("device nodes /dev/nvidia3, /dev/nvidia1 ")
    assert reasons[1].startswith("warning: the profile records no minor number for GPU 1 ")


def test_a_windows_plan_has_no_device_nodes_or_write_execute_decision():
    service = only(plan(DUAL, GEMMA))
    assert service.gpu_minors == [] and not service.memory_deny_write_execute
    assert not any("MemoryDenyWriteExecute" in reason or "device nodes" in reason for reason in service.reasons)


def _fleet(tmp_path, os: str = "linux"):
    data = {"boxes": {"box1": {"address": "127.0.0.1", "os": os, "models": [{"id": BIG122}],
                               "mirror": {"engines": "https://127.0.0.1:1/engines", "models": "http://127.0.0.1:1"}}}}
    return parse_fleet(data, tmp_path / "fleet.yml")


def _pinned(tmp_path):
    """The built-in catalog with the model's and the Windows downloads' sha256 pinned, as render requires."""
    builtin = load_catalog()
    extra = tmp_path / "pinned.yml"
    extra.write_text(yaml.safe_dump({
        "models": {BIG122: builtin.model(BIG122).model_dump(exclude={"id", "hub_url"}) | {"sha256": "cd" * 32}},
        "downloads": {"winsw-2.12.0": {"sha256": "ab" * 32}, "nvidia-windows-573.96": {"sha256": "ef" * 32}}}))
    return load_catalog([extra])


def test_render_hands_the_role_the_minor_numbers_uuids_and_the_write_execute_decision(tmp_path):
    box = _fleet(tmp_path).box("box1")
    twelve = profile(TWELVE)
    result = plan_box(box, twelve, _pinned(tmp_path))
    merged = host_vars(box, twelve, result)
    (instance,) = merged["llama_service_instances"]
    (service,) = result.services
    assert instance["gpu_minors"] == service.gpu_minors and instance["memory_deny_write_execute"] is True
    gpus = {gpu["index"]: gpu for gpu in merged["nvidia_driver_gpus"]}
    for card in twelve.gpus:
        assert gpus[card.index]["uuid"] == card.uuid and gpus[card.index]["minor_number"] == card.minor_number


def test_render_leaves_the_linux_sandbox_out_of_a_windows_box(tmp_path):
    box = _fleet(tmp_path, os="windows").box("box1")
    twelve = profile(TWELVE).model_copy(update={"os": OsInfo(family="windows")})
    result = plan_box(box, twelve, _pinned(tmp_path))
    assert result.services
    for instance in host_vars(box, twelve, result)["llama_service_instances"]:
        assert "gpu_minors" not in instance and "memory_deny_write_execute" not in instance
