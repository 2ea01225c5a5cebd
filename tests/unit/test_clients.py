"""``controller clients``: the contract fields for each client, the OpenClaw config merge, and its bad input."""

from __future__ import annotations

import json
import os

import json5
import pytest
import yaml

from ansible_collections.v100box.llm.plugins.filter.v100box import FilterModule, openclaw_problem
from ansible_collections.v100box.llm.plugins.plugin_utils.openclaw import OpenClawConfigError, merge_openclaw
from controller.model.fleet import WantedModel
from controller.stages.planner import plan_models
from tests.cli import invoke
from tests.unit.planner.helpers import CPU_ONLY, catalog, profile

GATE = "qwen3-4b-instruct-2507-q8_0"
KEY = "k3y-for-the-box-0123456789"


def _box(tmp_path, *, bind="127.0.0.1", api_key=True, plan=True, model=None):
    key = tmp_path / "api.key"
    key.write_text(KEY + "\n")
    body = {"address": "192.0.2.7", "bind": bind, "models": [model or {"id": GATE, "agents": ["claude-code"]}]}
    if bind != "127.0.0.1":
        body["allow_from"] = ["192.0.2.0/24"]
    if api_key:
        body["api_key"] = {"file": str(key)}
    fleet = tmp_path / "fleet.yml"
    fleet.write_text(yaml.safe_dump({"boxes": {"box1": body}}))
    if plan:
        result = plan_models([WantedModel.model_validate(body["models"][0])], profile(CPU_ONLY), catalog(), host=bind)
        (tmp_path / "inventory" / "plans").mkdir(parents=True)
        (tmp_path / "inventory" / "plans" / "box1.json").write_text(result.model_dump_json())
    return fleet


def test_the_json_contract_holds_everything_each_client_needs(tmp_path):
    outcome = invoke("clients", "box1", "--fleet", str(_box(tmp_path)), "--json")
    assert outcome.exit_code == 0, outcome.output
    answer = json.loads(outcome.stdout)
    assert answer["box"] == "box1"
    (service,) = answer["services"]
    assert service["model"] == GATE and service["base_url"].startswith("http://127.0.0.1:")
    env = service["claude_code"]["env"]
    assert env["ANTHROPIC_BASE_URL"] == service["base_url"] and env["ANTHROPIC_AUTH_TOKEN"] == KEY
    for name in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                 "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL"):
        assert env[name] == GATE
    ctx = service["ctx"]
    assert ctx >= 32768 and env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == str(ctx)
    assert 0 < int(env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]) <= ctx // 4
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    settings = service["claude_code"]["settings"]
    assert settings["model"] == GATE and KEY not in json.dumps(settings)
    provider = service["openclaw"]["provider"]
    assert provider["api"] == "openai-completions" and provider["baseUrl"] == service["base_url"] + "/v1"
    assert provider["apiKey"] == KEY
    (model,) = provider["models"]
    assert model["id"] == GATE and model["contextWindow"] == ctx and 0 < model["maxTokens"] <= ctx // 4
    assert set(model["cost"].values()) == {0}
    # OpenClaw's documented block for a custom provider in front of llama-server.
    assert model["compat"] == {"supportsTools": True, "toolSchemaProfile": "llamacpp"}
    assert service["warnings"] == []  # planned for Claude Code: enough context


def test_a_context_too_small_for_a_client_is_warned_with_the_numbers(tmp_path):
    """A service planned without naming the clients (4096 tokens here) gets a warning per client it is too small
    for, on stderr (stdout stays ready to paste) and in the JSON; the output itself is unchanged."""
    fleet = _box(tmp_path, model={"id": GATE, "ctx": 4096})
    outcome = invoke("clients", "box1", "--fleet", str(fleet), "--json")
    assert outcome.exit_code == 0, outcome.output
    (service,) = json.loads(outcome.stdout)["services"]
    assert service["ctx"] == 4096 and service["claude_code"]["env"]["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "4096"
    claude, openclaw = service["warnings"]
    assert "4096 tokens of context; claude-code needs at least 32768 (prefers 65536)" in claude
    assert "Prompt is too long" in claude and "agents: [claude-code]" in claude
    assert "openclaw needs at least 65536" in openclaw
    assert outcome.stderr.count("warning: box1: ") == 2
    text = invoke("clients", "box1", "--fleet", str(fleet), "--for", "claude-code")
    assert text.exit_code == 0 and "claude-code needs at least 32768" in text.stderr
    assert "openclaw" not in text.stderr and "warning" not in text.stdout


def test_a_context_enough_for_one_client_warns_for_the_other_only(tmp_path):
    outcome = invoke("clients", "box1", "--fleet", str(_box(tmp_path, model={"id": GATE, "ctx": 32768})), "--json")
    (service,) = json.loads(outcome.stdout)["services"]
    assert [warning.split(";")[1].split("(")[0].strip() for warning in service["warnings"]] == [
        "openclaw needs at least 65536"]


@pytest.mark.parametrize(("client", "present", "absent"), [("claude-code", "claude_code", "openclaw"),
                                                           ("openclaw", "openclaw", "claude_code")])
def test_for_filters_to_one_client(tmp_path, client, present, absent):
    outcome = invoke("clients", "box1", "--fleet", str(_box(tmp_path)), "--for", client, "--json")
    (service,) = json.loads(outcome.stdout)["services"]
    assert present in service and absent not in service


def test_a_box_listening_everywhere_is_reached_at_its_address(tmp_path):
    outcome = invoke("clients", "box1", "--fleet", str(_box(tmp_path, bind="0.0.0.0")), "--json")
    assert json.loads(outcome.stdout)["services"][0]["base_url"].startswith("http://192.0.2.7:")


def test_human_output_is_ready_to_paste(tmp_path):
    outcome = invoke("clients", "box1", "--fleet", str(_box(tmp_path)))
    assert outcome.exit_code == 0
    assert f"export ANTHROPIC_MODEL={GATE}" in outcome.stdout and "openai-completions" in outcome.stdout


@pytest.mark.parametrize(("args", "kwargs", "code", "words"), [
    (("nobox",), {}, 2, ["no box named 'nobox'"]),
    (("box1",), {"plan": False}, 1, ["has no plan for box1", "controller provision box1"]),
    (("box1",), {"api_key": False}, 2, ["box1", "set api_key"]),
])
def test_bad_input_is_one_line_and_a_documented_code(tmp_path, args, kwargs, code, words):
    outcome = invoke("clients", *args, "--fleet", str(_box(tmp_path, **kwargs)), "--json")
    assert outcome.exit_code == code and outcome.stdout == "" and "Traceback" not in outcome.output
    assert len(outcome.stderr.strip().splitlines()) == 1 and all(word in outcome.stderr for word in words)


# ---------------------------------------------------------------- OpenClaw's config


PROVIDER = {"baseUrl": "http://127.0.0.1:8001/v1", "apiKey": KEY, "api": "openai-completions",
            "models": [{"id": GATE, "contextWindow": 65536, "maxTokens": 16384}]}
USER_CONFIG = """// my OpenClaw settings
{
  agents: { defaults: { model: { primary: 'anthropic/claude-opus-4-6' }, workspace: '~/work', }, },
  channels: { telegram: { enabled: true, botToken: "123:abc" } },
  models: { providers: { ollama: { baseUrl: 'http://127.0.0.1:11434/v1', api: 'openai-completions', models: [] },
                         'v100-box1': { models: [{ id: 'my-own-model', contextWindow: 8192 }] } } },
}
"""


def test_merging_keeps_every_other_setting_and_model():
    merged = json5.loads(merge_openclaw(USER_CONFIG, "v100-box1", PROVIDER))
    assert merged["agents"]["defaults"]["model"]["primary"] == "anthropic/claude-opus-4-6"
    assert merged["channels"]["telegram"] == {"enabled": True, "botToken": "123:abc"}
    assert merged["models"]["providers"]["ollama"]["baseUrl"] == "http://127.0.0.1:11434/v1"
    ours = merged["models"]["providers"]["v100-box1"]
    assert ours["apiKey"] == KEY and [m["id"] for m in ours["models"]] == ["my-own-model", GATE]
    assert merged["models"]["mode"] == "merge"
    again = json5.loads(merge_openclaw(json.dumps(merged), "v100-box1", PROVIDER))
    assert again == merged  # merging twice changes nothing


def test_an_empty_config_gets_the_provider():
    assert json5.loads(merge_openclaw("", "v100-box1", PROVIDER))["models"]["providers"]["v100-box1"]["models"]


@pytest.mark.parametrize("text", ["{ models: { providers: { x: 1, } ", "[1, 2]", "{ models: { providers: [] } }"])
def test_a_config_that_is_not_json5_or_not_an_object_is_refused(text):
    with pytest.raises(OpenClawConfigError, match="left untouched"):
        merge_openclaw(text, "v100-box1", PROVIDER)


def test_the_filter_refuses_an_invalid_file_and_the_file_stays_as_it_was(tmp_path):
    from jinja2 import Environment

    env = Environment()
    env.filters.update(FilterModule().filters())
    path = tmp_path / "openclaw.json"
    path.write_text("{ broken: ")
    before = (path.read_bytes(), os.stat(path).st_mtime_ns)
    with pytest.raises(OpenClawConfigError, match="not valid JSON5"):
        env.from_string("{{ text | openclaw_merge(services, keys) }}").render(
            text=path.read_text(), keys={"llama-x": KEY},
            services=[{"name": "llama-x", "openclaw_provider_id": "v100-box1", "openclaw_provider": PROVIDER}])
    assert (path.read_bytes(), os.stat(path).st_mtime_ns) == before


def test_the_filter_merges_every_service_of_the_box_into_one_provider():
    from jinja2 import Environment

    env = Environment()
    env.filters.update(FilterModule().filters())
    services = [{"name": f"llama-{i}", "openclaw_provider_id": "v100-box1",
                 "openclaw_provider": {**PROVIDER, "models": [{"id": f"m{i}", "contextWindow": 65536}]}}
                for i in (1, 2)]
    text = env.from_string("{{ text | openclaw_merge(services, keys) }}").render(
        text=USER_CONFIG, services=services, keys={"llama-1": KEY, "llama-2": KEY})
    provider = json5.loads(text)["models"]["providers"]["v100-box1"]
    assert [m["id"] for m in provider["models"]] == ["my-own-model", "m1", "m2"] and provider["apiKey"] == KEY


def test_the_problem_filter_names_what_is_wrong_without_raising():
    assert openclaw_problem(USER_CONFIG) == ""
    assert "/home/u/.openclaw/openclaw.json is not valid JSON5" in openclaw_problem("{ a: ", "/home/u/.openclaw/openclaw.json")
