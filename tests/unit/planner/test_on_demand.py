"""On-demand groups in the plan: several models behind one router on the same cards, each planned alone there, as
many loaded at once as fit, and the refusals (issue 24)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.model.catalog import Catalog
from controller.model.clients import client_config
from controller.model.fleet import WantedModel, parse_fleet
from controller.model.serveplan import ServePlan
from controller.stages.planner import plan_box
from controller.stages.planner.commandline import preset_section
from controller.stages.planner.gateway import plan_gateway
from tests.unit.planner.helpers import CPU_ONLY, SINGLE, TWELVE, catalog, plan, profile

GEMMA = "gemma4-26b-a4b-qat-q4_0"  # ~13.4 GiB: one 16 GB card
QWEN = "qwen3.6-35b-a3b-iq4_xs"  # ~18.6 GB MoE, ik in the catalog: more than the card, experts to host RAM
GATE = "qwen3-4b-instruct-2507-q8_0"
W = WantedModel


def _service(result: ServePlan):
    assert result.fits, result.unplaced
    (service,) = result.services
    return service


def test_the_kits_two_models_on_one_16_gb_card_take_turns_behind_one_port():
    service = _service(plan(SINGLE, W(id=GEMMA, on_demand=True), W(id=QWEN, on_demand=True)))
    assert service.name == "llama-on-demand" and service.model == GEMMA and service.models == [GEMMA, QWEN]
    assert service.gpus == [0] and service.port == 8001 and service.engine == "upstream-02182fc"
    group = service.on_demand
    assert group is not None and group.max_loaded == 1 and group.key_file_env == "LLAMA_ARG_API_KEY_FILE"
    assert service.args == ["--models-preset", "/etc/llama/presets/llama-on-demand.ini", "--models-max", "1",
                            "--host", "127.0.0.1", "--port", "8001"]
    gemma, qwen = group.models
    # Each planned alone on the card, with its own context, cache and flags.
    assert gemma.preset["model"] == "/var/lib/llama/models/gemma-4-26B_q4_0-it.gguf" and not gemma.cpu_offload
    assert qwen.cpu_offload and "n-cpu-moe" in qwen.preset and "fit" not in qwen.preset  # upstream's offload
    assert qwen.preset["chat-template-file"].endswith("qwen3.6-nothink.jinja") and qwen.preset["mlock"] == "true"
    assert all(key not in item.preset for item in group.models for key in ("alias", "host", "port"))
    assert all(item.preset["stop-timeout"] == "3" for item in group.models)  # measured: exits hang on a GPU
    assert gemma.ctx != qwen.ctx and gemma.preset["ctx-size"] == str(gemma.ctx)
    assert any("--models-max 1: at most 1 of the 2 models fit at once" in reason for reason in service.reasons)
    assert any("upstream rather than the ik_llama.cpp its catalog entry names" in r for r in service.reasons)
    # The member's own reasons are true of it in the group: its engine, its offload flag, who keeps the margin.
    assert qwen.reasons[0].startswith("engine upstream-02182fc, upstream llama.cpp: served on demand by its router")
    assert any(r.startswith("--n-cpu-moe") and "served on demand, by upstream's router mode" in r for r in qwen.reasons)
    assert not any("ik_llama.cpp's --fit keeps" in r or "asks for it" in r for r in qwen.reasons)
    assert not any(r.startswith(("port ", "API key required")) for item in group.models for r in item.reasons)
    assert any("LLAMA_ARG_API_KEY_FILE" in reason and "refuse a request without it" in reason
               for reason in service.reasons)
    assert service.memory.per_device_mib["cuda0"] <= 16384


def test_every_model_file_and_template_of_the_group_is_fetched_and_each_is_a_client_model():
    result = plan(SINGLE, W(id=GEMMA, on_demand=True), W(id=QWEN, on_demand=True))
    assert {item.id for item in result.models} == {GEMMA, QWEN}
    assert result.templates() == {"gemma4-nothink.jinja", "qwen3.6-nothink.jinja"}
    box = parse_fleet({"boxes": {"box3": {"address": "127.0.0.1", "models": [{"id": GEMMA}]}}},
                      Path("fleet.yml")).box("box3")
    clients = client_config(box, result, "k" * 20)["services"]
    assert [(entry["model"], entry["base_url"]) for entry in clients] == [(GEMMA, "http://127.0.0.1:8001"),
                                                                          (QWEN, "http://127.0.0.1:8001")]
    assert clients[1]["ctx"] == result.services[0].on_demand.models[1].ctx


def test_as_many_load_at_once_as_fit_and_the_fleet_may_ask_for_fewer():
    service = _service(plan(TWELVE, W(id=GATE, on_demand="small", gpus=[0]), W(id=GEMMA, on_demand="small", gpus=[0])))
    assert service.name == "llama-on-demand-small" and service.on_demand.max_loaded == 1  # 32 GB: not both at 128k
    tight = _service(plan(TWELVE, W(id=GATE, ctx=8192, on_demand=True), W(id=GEMMA, ctx=8192, on_demand=True)))
    assert tight.gpus == [3] and tight.on_demand.max_loaded == 1  # the best fit for the largest: the 16 GB card
    roomy = _service(plan(TWELVE, W(id=GATE, ctx=8192, on_demand=True, gpus=[0]),
                          W(id=GEMMA, ctx=8192, on_demand=True, gpus=[0])))
    assert roomy.on_demand.max_loaded == 2 and roomy.gpus == [0]
    capped = plan_box(parse_fleet({"boxes": {"b": {"address": "127.0.0.1", "on_demand_max": 1, "models": [
        {"id": GATE, "ctx": 8192, "on_demand": True, "gpus": [0]},
        {"id": GEMMA, "ctx": 8192, "on_demand": True, "gpus": [0]}]}}},
        Path("fleet.yml")).box("b"), profile(TWELVE), catalog())
    assert capped.services[0].on_demand.max_loaded == 1
    assert any("the fleet's on_demand_max (up to 2 would fit at once)" in r for r in capped.services[0].reasons)


def test_a_model_that_does_not_fit_the_groups_cards_alone_is_refused_at_plan_time():
    result = plan(SINGLE, W(id=GEMMA, on_demand=True), W(id=GATE, ctx=262144, on_demand=True))
    assert [s.models for s in result.services] == [[GEMMA]] and not result.fits
    (refused,) = result.unplaced
    assert refused.model == GATE and "does not fit" in refused.reason and "MiB" in refused.reason
    assert "on-demand group default holds its models on the cards of its largest, gemma4-26b-a4b-qat-q4_0" in \
        refused.reason


def test_a_group_on_an_engine_without_router_mode_and_on_windows_is_refused():
    pinned = plan(SINGLE, W(id=QWEN, on_demand=True, engine="ik-022bd00a"))
    assert not pinned.services and "names engine ik-022bd00a for it, which has no router mode" in \
        pinned.unplaced[0].reason
    windows = plan_box(parse_fleet({"boxes": {"w": {"address": "127.0.0.1", "os": "windows", "models": [
        {"id": GEMMA, "on_demand": True}]}}}, Path("fleet.yml")).box("w"), profile(SINGLE), catalog())
    assert not windows.services and "a Windows box serves each model as a service of its own" in \
        windows.unplaced[0].reason


def test_a_cpu_box_serves_a_group_from_host_ram():
    service = _service(plan(CPU_ONLY, W(id=GATE, ctx=4096, on_demand=True),
                            W(id="qwen2.5-coder-0.5b-instruct-q8_0", ctx=4096, on_demand=True)))
    assert service.engine.startswith("cpu-") and service.gpus == [] and service.on_demand.max_loaded == 2
    assert all(item.preset["load-mode"] in ("mmap", "mlock") for item in service.on_demand.models)
    assert all("stop-timeout" not in item.preset for item in service.on_demand.models)  # CPU servers exit at once


def test_groups_and_ordinary_services_share_a_box_and_a_gateway_routes_every_model():
    fleet = parse_fleet({"boxes": {"box3": {"address": "127.0.0.1", "gateway": {"port": 9000, "api_key": {
        "env": "HOME"}}, "models": [
        {"id": GATE, "ctx": 8192}, {"id": GEMMA, "ctx": 8192, "on_demand": True},
        {"id": "qwen2.5-coder-7b-instruct-q4_k_m", "ctx": 8192, "on_demand": True}]}}}, Path("fleet.yml"))
    box = fleet.box("box3")
    result = plan_box(box, profile(TWELVE), catalog())
    assert [s.models for s in result.services] == [[GATE], [GEMMA, "qwen2.5-coder-7b-instruct-q4_k_m"]]
    assert [s.port for s in result.services] == [8001, 8002]
    assert not set(result.services[0].gpus) & set(result.services[1].gpus)
    gateway = plan_gateway(box, result, {})
    assert {route.model: route.port for route in gateway.routes} == {
        GATE: 8001, GEMMA: 8002, "qwen2.5-coder-7b-instruct-q4_k_m": 8002}


@pytest.mark.parametrize("models,message", [
    ([{"id": GEMMA, "on_demand": True, "board": 0}, {"id": QWEN, "on_demand": True, "board": 1}],
     "on-demand group default: its models share the same cards"),
    ([{"id": GEMMA, "on_demand": "a"}, {"id": GEMMA, "on_demand": "a"}], "names gemma4-26b-a4b-qat-q4_0 twice"),
])
def test_a_group_whose_models_disagree_is_refused_by_the_fleet_file(models, message):
    with pytest.raises(Exception, match=message):
        parse_fleet({"boxes": {"b": {"address": "127.0.0.1", "models": models}}}, Path("fleet.yml"))


def test_a_preset_section_spells_each_flag_and_refuses_what_the_ini_would_cut():
    assert preset_section(["--model", "/m/a b.gguf", "--alias", "a", "--host", "127.0.0.1", "--port", "1", "--jinja",
                           "--ctx-size", "4096", "--no-mmap", "--mlock"]) == {
        "model": "/m/a b.gguf", "jinja": "true", "ctx-size": "4096", "no-mmap": "true", "mlock": "true"}
    with pytest.raises(ValueError, match="cannot be written in the router's preset file"):
        preset_section(["--model", "/m/x ;y.gguf"])


def test_the_catalog_names_router_mode_only_where_the_engine_has_it():
    cat: Catalog = catalog()
    assert cat.engine("cpu-0c1e570").router is not None and cat.engine("upstream-02182fc").router is not None
    assert cat.engine("ik-022bd00a").router is None


def test_the_lock_records_each_on_demand_models_flags_and_names_a_change():
    from controller.actions.lock import box_entry, differences

    box = parse_fleet({"boxes": {"b": {"address": "127.0.0.1", "models": [
        {"id": GEMMA, "on_demand": True}, {"id": QWEN, "on_demand": True}]}}}, Path("fleet.yml")).box("b")
    before = plan(SINGLE, W(id=GEMMA, on_demand=True), W(id=QWEN, on_demand=True))
    after = plan(SINGLE, W(id=GEMMA, on_demand=True), W(id=QWEN, ctx=32768, on_demand=True))
    assert before.services[0].args == after.services[0].args  # the router's own line does not show it
    locked, fresh = box_entry(box, None, before, {}), box_entry(box, None, after, {})
    assert locked.services["llama-on-demand"].on_demand[QWEN]["ctx-size"] == str(before.services[0].on_demand.models[1].ctx)
    (line,) = [line for line in differences(locked, fresh) if "on_demand" in line]
    assert line.startswith("service llama-on-demand: on_demand is now")


def test_a_model_folder_the_preset_file_cannot_hold_is_one_clear_error():
    from controller.errors import PlanError
    from controller.stages.planner import plan_models

    with pytest.raises(PlanError, match="in on-demand group default: --model .* cannot be written in the router's "
                                        "preset file"):
        plan_models([W(id=GATE, on_demand=True)], profile(SINGLE), catalog(), model_dir="/models ;old")


def test_a_pin_on_any_model_of_a_group_places_the_whole_group():
    # The pin is on the smaller model; the largest, placed first, takes the group to those cards too.
    service = _service(plan(TWELVE, W(id=GATE, ctx=8192, on_demand=True, gpus=[6]),
                            W(id=GEMMA, ctx=8192, on_demand=True)))
    assert service.gpus == [6] and all(item.gpus == [6] for item in service.on_demand.models)
