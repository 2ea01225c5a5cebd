"""The llama_api_check module against the real CPU llama-server, run as Ansible runs a module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.target import free_port
from tests.unit.plugins import loader

pytestmark = pytest.mark.engine

KEY = "check-key-0123456789abcdef"


def run_module(tmp_path: Path, **args) -> dict:
    return loader.run_module("llama_api_check", tmp_path, args, timeout=180)[1]


@pytest.fixture(scope="module")
def server(llama_server, tmp_path_factory):
    with loader.tiny_server(llama_server, tmp_path_factory.mktemp("m"), KEY, "-c", "1024", "-np", "1") as running:
        yield running


def test_both_apis_answer_as_the_model(server, tmp_path):
    result = run_module(tmp_path, base_url=server.url, model="tiny", api_key=KEY, max_tokens=4)
    assert not result.get("failed"), result
    assert result["changed"] is False and result["health"] == "ok" and result["served_ids"] == ["tiny"]
    assert result["openai"]["object"] == "chat.completion" and result["openai"]["completion_tokens"] > 0
    assert result["anthropic"]["type"] == "message" and result["anthropic"]["output_tokens"] > 0
    assert KEY not in json.dumps(result)


def test_wrong_model_id_fails_with_what_is_served(server, tmp_path):
    result = run_module(tmp_path, base_url=server.url, model="gemma4-26b-a4b-qat-q4_0", api_key=KEY, max_tokens=2)
    assert result["failed"] and "serves ['tiny'], not gemma4-26b-a4b-qat-q4_0" in result["msg"]


def test_missing_key_and_dead_server_fail_clearly(server, tmp_path):
    result = run_module(tmp_path, base_url=server.url, model="tiny", max_tokens=2)
    assert result["failed"] and "/v1/models answered HTTP 401" in result["msg"]
    dead = run_module(tmp_path, base_url=f"http://127.0.0.1:{free_port()}", model="tiny", timeout=5)
    assert dead["failed"] and dead["health"] == "unreachable" and "/health" in dead["msg"]


def test_a_check_of_a_plain_http_server_builds_no_tls_context(server, tmp_path):
    # Health, the model list, a turn through each API and two refusals: six requests to a plain-HTTP server and no TLS
    # context (ansible's open_url builds one, loading the CA store, for every request: about 20 ms of CPU each).
    # sitecustomize counts the contexts built.
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import atexit, ssl\n"
        "_real, _built = ssl.create_default_context, []\n"
        "def _counting(*a, **k):\n"
        "    _built.append(1)\n"
        "    return _real(*a, **k)\n"
        "ssl.create_default_context = _counting\n"
        f"atexit.register(lambda: open({str(tmp_path / 'built')!r}, 'w').write(str(len(_built))))\n")
    env = loader.module_env()
    env["PYTHONPATH"] = f"{hook}:{env['PYTHONPATH']}"
    done, result = loader.run_module("llama_api_check", tmp_path, {"base_url": server.url, "model": "tiny",
                                                                   "api_key": KEY, "max_tokens": 2}, env=env)
    assert not result.get("failed"), result
    assert result["auth"]["anonymous_status"] == result["auth"]["wrong_key_status"] == 401
    assert (tmp_path / "built").read_text() == "0"
