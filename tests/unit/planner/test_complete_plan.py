"""The plan is complete: every decision a role acts on is in it, resolved, with its reason."""

from __future__ import annotations

import pytest

from controller.model.fleet import parse_fleet
from controller.model.rules import DEFAULT_MODEL_DIR, TEMPLATE_DIR
from controller.stages.planner import plan_box
from controller.stages.render import host_vars
from tests.unit.planner.helpers import DUAL, SINGLE, TWELVE, catalog, plan, profile

GEMMA, Q6K, DENSE = "gemma4-26b-a4b-qat-q4_0", "qwen3.6-35b-a3b-q6_k", "qwen3.6-27b-q4_k_m"
MIRROR = {"engines": "https://mirror.lan/engines", "models": "https://mirror.lan/hf"}


def _box(tmp_path, os="linux", **extra):
    box = {"address": "10.0.0.5", "os": os, "mirror": MIRROR, "models": [{"id": GEMMA}], **extra}
    return parse_fleet({"boxes": {"b1": box}}, tmp_path / "fleet.yml").box("b1")


def test_every_service_says_why_its_engine(tmp_path):
    dual_q6k = plan(DUAL, Q6K)
    (service,) = dual_q6k.services
    (why,) = [reason for reason in service.reasons if reason.startswith("engine ")]
    assert service.engine.startswith("ik-") and "ik_llama.cpp" in why and "catalog entry" in why, why
    dense = plan(DUAL, DENSE)
    (why,) = [reason for reason in dense.services[0].reasons if reason.startswith("engine ")]
    assert "upstream" in why and "tensor split" in why, why
    sliding = plan(SINGLE, GEMMA)
    (why,) = [reason for reason in sliding.services[0].reasons if reason.startswith("engine ")]
    assert "sliding-window" in why, why
    cpu = plan("cpu-only-no-driver", "qwen3-4b-instruct-2507-q8_0")
    (why,) = [reason for reason in cpu.services[0].reasons if reason.startswith("engine ")]
    assert "CPU-only build" in why, why


def test_plan_carries_sources_folders_and_flags(tmp_path):
    box = _box(tmp_path)
    result = plan_box(box, profile(SINGLE), catalog())
    assert result.os == "linux" and result.model_dir == DEFAULT_MODEL_DIR["linux"]
    assert result.template_dir == TEMPLATE_DIR["linux"]
    (engine,) = result.engines
    (service,) = result.services
    assert engine.id == service.engine and engine.slot == "upstream" and engine.platform == "linux-x86_64"
    assert engine.download.url == f"{MIRROR['engines']}/{engine.download.file}"
    assert (engine.download.sha256 is None) == (engine.download.sha256sums_url is not None)
    (model,) = result.models
    entry = catalog().model(GEMMA)
    assert (model.file, model.sha256) == (entry.file, entry.sha256)
    assert model.url == f"{MIRROR['models']}/{entry.repo}/resolve/main/{entry.file}" and model.token is False
    assert service.template_file == f"{TEMPLATE_DIR['linux']}/{entry.template}"
    assert service.template_file in service.args and service.mlock is False and service.nccl is False
    assert result.driver is not None and result.driver.branch == 580 and result.driver.reasons


def test_offload_locks_memory_and_tensor_split_asks_for_nccl():
    offload = plan(SINGLE, Q6K)
    (service,) = offload.services
    assert service.cpu_offload and service.mlock
    tensor = plan(DUAL, DENSE)
    (service,) = tensor.services
    assert service.split_mode == "tensor" and service.nccl == (service.env.get("GGML_CUDA_ALLREDUCE") == "nccl")
    assert service.nccl


def test_windows_plan_knows_its_os_without_guessing_from_the_folder(tmp_path):
    box = _box(tmp_path, os="windows", model_dir="D:/llm/models")
    result = plan_box(box, profile(DUAL), catalog())
    (service,) = result.services
    assert result.os == "windows" and result.model_dir == "D:\\llm\\models"
    assert service.template_file.startswith(TEMPLATE_DIR["windows"] + "\\")
    assert result.engines[0].platform == "windows-x86_64" and result.service_wrapper is not None
    assert result.driver.mode == "tcc"


@pytest.mark.parametrize("field, value, key", [("mlock", True, "mlock"), ("nccl", True, "nccl")])
def test_render_projects_the_plan_and_never_decides_again(tmp_path, field, value, key):
    """Rendering reads the decision from the plan, not from the argument strings or the environment."""
    box = _box(tmp_path, models=[{"id": "qwen3-4b-instruct-2507-q8_0"}])
    cat = catalog().model_copy(deep=True)
    for entry in cat.models.values():
        entry.sha256 = entry.sha256 or "ab" * 32
    result = plan_box(box, profile(SINGLE), cat)
    (service,) = result.services
    assert getattr(service, field) is not value
    setattr(service, field, value)
    (instance,) = host_vars(box, profile(SINGLE), result)["llama_service_instances"]
    assert instance[key] is value


def test_twelve_gpu_box_plans_every_board_with_reasons():
    result = plan(TWELVE, GEMMA, DENSE, Q6K)
    assert result.fits
    for service in result.services:
        assert any(reason.startswith("engine ") for reason in service.reasons)
        assert service.engine in {engine.id for engine in result.engines}
