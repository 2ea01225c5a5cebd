"""Render refuses servers that would really bind beyond loopback without a key, and passes the key the
way each pinned engine reads it (issue 9: the bind check, the API key on every server)."""

from __future__ import annotations

import pytest

from controller.errors import FleetError, PlanError
from controller.model.catalog import load_catalog
from controller.model.fleet import check_api_key, parse_fleet
from controller.stages.render import secrets_for
from tests.unit.tiny_box import tiny_box_vars, tiny_catalog_file

SHA = "cd" * 32


@pytest.fixture
def catalog(tmp_path):
    return load_catalog([tiny_catalog_file(tmp_path, SHA)])


def rendered(tmp_path, catalog, **box):
    return tiny_box_vars(tmp_path, catalog, **{
        "models": [{"id": "tiny"}],
        "mirror": {"engines": "https://127.0.0.1:1/engines", "models": "http://127.0.0.1:1"}, **box})


def test_vars_that_bind_everywhere_without_a_key_are_refused(tmp_path, catalog):
    # Reproduced in the issue: box vars replace the instances with --host 0.0.0.0; the fleet's bind stays
    # loopback, so the old check (on llama_service_bind) passed and the server listened unauthenticated.
    plain = rendered(tmp_path, catalog)
    exposed = [dict(instance, args=["0.0.0.0" if arg == "127.0.0.1" else arg for arg in instance["args"]])
               for instance in plain["llama_service_instances"]]
    with pytest.raises(PlanError, match=r"would bind 0\.0\.0\.0 \(its --host\), but llama_service_bind is 127\.0\.0\.1"):
        rendered(tmp_path, catalog, vars={"llama_service_instances": exposed})
    with pytest.raises(PlanError, match="without an API key; set api_key in the fleet file"):
        rendered(tmp_path, catalog, vars={"llama_service_instances": exposed, "llama_service_bind": "0.0.0.0"})
    with pytest.raises(PlanError, match="list the networks that may connect in allow_from"):
        rendered(tmp_path, catalog, api_key={"env": "HOME"},
                 vars={"llama_service_instances": exposed, "llama_service_bind": "0.0.0.0"})
    env_exposed = [dict(i, env={"LLAMA_ARG_HOST": "0.0.0.0"}) for i in plain["llama_service_instances"]]
    with pytest.raises(PlanError, match=r"would bind 0\.0\.0\.0"):
        rendered(tmp_path, catalog, vars={"llama_service_instances": env_exposed})


def test_an_exposed_box_with_key_and_networks_renders_them_for_the_roles(tmp_path, catalog):
    out = rendered(tmp_path, catalog, bind="0.0.0.0", allow_from=["10.0.0.0/8"], api_key={"env": "HOME"})
    (instance,) = out["llama_service_instances"]
    assert out["llama_service_bind"] == "0.0.0.0" and out["llama_service_allow_from"] == ["10.0.0.0/8"]
    assert instance["args"][instance["args"].index("--host") + 1] == "0.0.0.0"
    # The key goes as a file the engine reads with its own flag, never on the command line or in the env.
    assert instance["api_key_flag"] == "--api-key-file" and instance["no_slots_flags"] == ["--no-slots"]
    assert not any(arg.startswith("--api-key") for arg in instance["args"])
    assert "LLAMA_API_KEY" not in instance["env"]


def test_every_pinned_engine_records_how_it_reads_the_key():
    engines = load_catalog().engines
    assert {engine.api_key.file_flag for engine in engines.values()} == {"--api-key-file"}
    assert engines["ik-022bd00a"].api_key.env is None  # ik reads no LLAMA_API_KEY (its common/common.cpp)
    assert engines["upstream-02182fc"].api_key.env == "LLAMA_API_KEY"
    assert all(engine.no_slots_flags == ["--no-slots"] for engine in engines.values())


@pytest.mark.parametrize("key", ['mk\\ey"with\'quotes-0123', "0123456789abcdef$%{}!~"])
def test_keys_systemd_would_rewrite_pass_verbatim(key):
    assert check_api_key(key, "box b api_key") == key


@pytest.mark.parametrize("key", ["trailing-space-key-0123 ", "has a space in it 0123", "#comment-line-0123456",
                                 "short", "tab\tkey-0123456789", "unicode-é-key-0123456"])
def test_keys_a_server_would_not_match_are_refused_with_one_line(key):
    with pytest.raises(FleetError) as caught:
        check_api_key(key, "box b api_key")
    assert "\n" not in str(caught.value) and "box b api_key: use 16 to 256 printable ASCII" in str(caught.value)
    assert key.strip() not in str(caught.value)  # the message never repeats the secret


def test_secrets_refuse_a_key_with_a_trailing_space(tmp_path, monkeypatch):
    monkeypatch.setenv("ODD_KEY", "odd-key-0123456789 ")
    fleet = parse_fleet({"boxes": {"b": {"address": "127.0.0.1", "api_key": {"env": "ODD_KEY"}}}},
                        tmp_path / "fleet.yml")
    with pytest.raises(FleetError, match="box b api_key: use 16 to 256"):
        secrets_for(fleet.box("b"))
