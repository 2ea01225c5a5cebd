"""The llama_api_check module against the real CPU llama-server, run as Ansible runs a module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab import tinymodels
from lab.llama_server import serve
from lab.target import free_port

pytestmark = pytest.mark.engine

MODULE = Path(__file__).resolve().parents[3] / "ansible_collections/v100box/llm/plugins" / "modules" / "llama_api_check.py"
KEY = "check-key-0123456789abcdef"


def run_module(tmp_path: Path, **args) -> dict:
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    done = subprocess.run([sys.executable, str(MODULE), str(args_file)], capture_output=True, text=True,
                          timeout=180, check=False)
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def server(llama_server, tmp_path_factory):
    model = tinymodels.write_model(tmp_path_factory.mktemp("m") / "tiny.gguf", "llama", file_type="q8_0")
    with serve(llama_server, model, ["--alias", "tiny", "--api-key", KEY, "-c", "1024", "-np", "1"]) as running:
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
