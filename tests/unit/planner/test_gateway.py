"""The gateway plan (issue 11): routes from model id to the planned services of the box and of the boxes it
names, with reasons; render projects it for roles/llm_gateway, whose HAProxy configuration is rendered here by
Ansible's template engine and holds no key; secrets carry the keys."""

from __future__ import annotations

import pytest
import yaml

from controller.errors import FleetError, PlanError
from controller.model.catalog import load_catalog
from controller.model.fleet import parse_fleet
from controller.stages.planner import plan_box
from controller.stages.planner.gateway import BUFFER_MIN, plan_gateway
from controller.stages.render import host_vars, secrets_for
from lab import localplay
from tests.unit.tiny_box import CPU_PROFILE, tiny_catalog_file

SHA = "ab" * 32
MIRROR = {"engines": "https://127.0.0.1:1/engines", "models": "http://127.0.0.1:1"}


@pytest.fixture
def catalog(tmp_path):
    path = tiny_catalog_file(tmp_path, SHA)
    data = yaml.safe_load(path.read_text())
    data["models"]["tiny-b"] = dict(data["models"]["tiny"], file="b.gguf")
    path.write_text(yaml.safe_dump(data))
    return load_catalog([path])


def _fleet(tmp_path, gw: dict | None = None, **boxes):
    (tmp_path / "gw_key").write_text("gateway-key-0123456789")
    (tmp_path / "far_key").write_text("far-box-key-0123456789")
    body = {"boxes": {
        "gw": {"address": "10.0.0.1", "models": [{"id": "tiny"}, {"id": "tiny-b"}], "mirror": MIRROR,
               "gateway": {"api_key": {"file": str(tmp_path / "gw_key")}, **(gw or {})}},
        "far": {"address": "10.0.0.2", "bind": "0.0.0.0", "allow_from": ["10.0.0.0/24"], "mirror": MIRROR,
                "api_key": {"file": str(tmp_path / "far_key")}, "models": [{"id": "tiny-b"}, {"id": "tiny"}],
                "base_port": 9001},
        **boxes,
    }}
    return parse_fleet(body, tmp_path / "fleet.yml")


def _plans(fleet, catalog):
    return {name: plan_box(box, CPU_PROFILE, catalog) for name, box in fleet.boxes.items()}


def test_routes_the_boxs_own_services_with_reasons(tmp_path, catalog):
    fleet = _fleet(tmp_path)
    plans = _plans(fleet, catalog)
    gateway = plan_gateway(fleet.box("gw"), plans["gw"], {})
    assert [(r.model, r.box, r.host, r.port, r.local) for r in gateway.routes] == [
        ("tiny", "gw", "127.0.0.1", 8001, True), ("tiny-b", "gw", "127.0.0.1", 8002, True)]
    assert (gateway.port, gateway.metrics_port, gateway.bind, gateway.buffer_bytes) == (8000, 8404, "127.0.0.1",
                                                                                         BUFFER_MIN)
    assert gateway.connect_timeout_ms < 1000
    assert any("loopback only" in reason for reason in gateway.reasons)
    assert any("within a second" in reason for reason in gateway.reasons)


def test_routes_to_another_box_at_its_address_and_the_first_box_serving_a_model_answers(tmp_path, catalog):
    fleet = _fleet(tmp_path, gw={"boxes": ["far"]}, third={"address": "10.0.0.3", "bind": "10.0.0.3",
                   "allow_from": ["10.0.0.0/24"], "api_key": {"env": "UNUSED"}, "models": [{"id": "tiny"}]})
    plans = _plans(fleet, catalog)
    plans["gw"].services = plans["gw"].services[:1]  # gw serves tiny only; far answers tiny-b
    gateway = plan_gateway(fleet.box("gw"), plans["gw"], {"far": (fleet.box("far"), plans["far"])})
    assert [(r.model, r.box, r.host, r.port, r.local) for r in gateway.routes] == [
        ("tiny", "gw", "127.0.0.1", 8001, True), ("tiny-b", "far", "10.0.0.2", 9001, False)]
    assert any("not routed: tiny on far (answered by gw)" in reason for reason in gateway.reasons)


def test_a_bigger_context_gets_a_bigger_buffer(tmp_path, catalog):
    fleet = _fleet(tmp_path)
    plan = _plans(fleet, catalog)["gw"]
    plan.services[0].ctx = 262144
    assert plan_gateway(fleet.box("gw"), plan, {}).buffer_bytes == 2 << 20


@pytest.mark.parametrize(("change", "message"), [
    ({"far": None}, "its gateway routes to box far, which has no plan in the inventory yet; provision far first"),
    ({"bind": "127.0.0.1"}, "whose servers bind 127.0.0.1 (that box only); set bind"),
    ({"api_key": None}, "which has no api_key in the fleet file"),
])
def test_refuses_a_box_it_cannot_route_to(tmp_path, catalog, change, message):
    fleet = _fleet(tmp_path, gw={"boxes": ["far"]})
    plans = _plans(fleet, catalog)
    far = fleet.box("far")
    if "bind" in change:
        far = far.model_copy(update={"bind": change["bind"]})
    if "api_key" in change:
        far = far.model_copy(update={"api_key": None})
    plan = None if change.get("far", 1) is None else plans["far"]
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_gateway(fleet.box("gw"), plans["gw"], {"far": (far, plan)})


def test_refuses_a_port_a_service_has_and_a_windows_box(tmp_path, catalog):
    fleet = _fleet(tmp_path, gw={"port": 8002})
    plans = _plans(fleet, catalog)
    with pytest.raises(PlanError, match="gateway.port 8002 is the port of llama-tiny-b"):
        plan_gateway(fleet.box("gw"), plans["gw"], {})
    windows = fleet.box("gw").model_copy(update={"os": "windows"})
    with pytest.raises(PlanError, match="the gateway runs on Linux boxes only"):
        plan_gateway(windows, plans["gw"], {})


def test_the_fleet_refuses_a_gateway_naming_an_unknown_box(tmp_path):
    with pytest.raises(FleetError, match="gateway.boxes names 'nowhere', which is not a box of this fleet"):
        _fleet(tmp_path, gw={"boxes": ["nowhere"]})
    with pytest.raises(FleetError, match=r"gateway.api_key.*Field required|field 'gateway.api_key'"):
        parse_fleet({"boxes": {"gw": {"address": "10.0.0.1", "gateway": {}}}}, tmp_path / "fleet.yml")


def test_render_projects_the_routes_and_secrets_carry_the_keys(tmp_path, catalog):
    fleet = _fleet(tmp_path, gw={"boxes": ["far"]})
    plans = _plans(fleet, catalog)
    plans["gw"].gateway = plan_gateway(fleet.box("gw"), plans["gw"], {"far": (fleet.box("far"), plans["far"])})
    rendered = host_vars(fleet.box("gw"), CPU_PROFILE, plans["gw"])
    assert rendered["llm_gateway_port"] == 8000 and rendered["llm_gateway_buffer_bytes"] == BUFFER_MIN
    assert rendered["llm_gateway_routes"][0] == {"model": "tiny", "box": "gw", "service": "llama-tiny",
                                                 "host": "127.0.0.1", "port": 8001, "local": True}
    assert "gateway-key" not in yaml.safe_dump(rendered)
    assert secrets_for(fleet.box("gw"), fleet) == {"llm_gateway_api_key": "gateway-key-0123456789",
                                                   "llm_gateway_box_keys": {"far": "far-box-key-0123456789"}}
    assert "llm_gateway_routes" not in host_vars(fleet.box("far"), CPU_PROFILE, plans["far"])


def test_the_haproxy_configuration_names_models_and_boxes_in_its_errors_and_holds_no_key(tmp_path, catalog):
    fleet = _fleet(tmp_path, gw={"boxes": ["far"]})
    plans = _plans(fleet, catalog)
    plans["gw"].services = plans["gw"].services[:1]
    plans["gw"].gateway = plan_gateway(fleet.box("gw"), plans["gw"], {"far": (fleet.box("far"), plans["far"])})
    variables = {key: value for key, value in host_vars(fleet.box("gw"), CPU_PROFILE, plans["gw"]).items()
                 if key.startswith("llm_gateway_")} | secrets_for(fleet.box("gw"), fleet)
    templates = localplay.ROLES / "llm_gateway" / "templates"
    localplay.run_play("llm_gateway", [localplay.template(templates / "{{ item }}.j2", tmp_path / "{{ item }}",
                                                          loop=["haproxy.cfg", "llm-gateway.service"])],
                       variables, tmp_path, timeout=120)
    config = (tmp_path / "haproxy.cfg").read_text()
    assert "bind 127.0.0.1:8000" in config and "tune.bufsize 1048576" in config
    assert "served models: tiny, tiny-b" in config
    assert "model tiny-b on box far (10.0.0.2:9001) is not answering" in config
    assert "server far 10.0.0.2:9001 check" in config and "timeout connect 900ms" in config
    assert "gateway-key" not in config and "far-box-key" not in config
    unit = (tmp_path / "llm-gateway.service").read_text()
    assert "IPAddressAllow=10.0.0.2" in unit and "DynamicUser=yes" in unit


def test_the_plan_command_prints_the_routes_and_their_reasons(tmp_path, catalog, capsys):
    from controller.cli.plan import emit

    fleet = _fleet(tmp_path)
    plan = _plans(fleet, catalog)["gw"]
    plan.gateway = plan_gateway(fleet.box("gw"), plan, {})
    emit(plan, as_json=False)
    out = capsys.readouterr().out
    assert "gateway on port 8000: tiny -> gw 127.0.0.1:8001, tiny-b -> gw 127.0.0.1:8002" in out
    assert "  - routes by the model name in the request body: tiny, tiny-b" in out
