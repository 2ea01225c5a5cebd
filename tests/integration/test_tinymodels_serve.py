"""The real CPU llama-server loads each generated architecture and answers both chat APIs."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from lab.llama_server import serve
from lab.tinymodels import ARCHS, write_model, write_scripted_model

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("arch", ARCHS)
def test_server_answers_openai_and_anthropic_apis(tmp_path: Path, llama_server: Path, arch: str) -> None:
    model = write_model(tmp_path / f"{arch}.gguf", arch, file_type="q8_0", name=f"tiny-{arch}")
    with serve(llama_server, model, ["-c", "1024"]) as server:
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 200

        chat = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
                  "max_tokens": 8, "temperature": 0},
            timeout=60,
        )
        assert chat.status_code == 200, chat.text
        body = chat.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] >= 1

        messages = httpx.post(
            f"{server.url}/v1/messages",
            json={"model": "tiny", "max_tokens": 8, "system": "be brief",
                  "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]},
            timeout=60,
        )
        assert messages.status_code == 200, messages.text
        reply = messages.json()
        assert reply["type"] == "message" and reply["role"] == "assistant"
        assert reply["content"][0]["type"] == "text"
        assert reply["usage"]["output_tokens"] >= 1
        log = server.log()
    assert re.search(rf"print_info: arch\s+= {arch}$", log, re.MULTILINE)
    if arch == "gemma3":
        # the sliding-window layers got their own (iSWA) cache
        assert "creating     SWA KV cache" in log
    if arch == "qwen3moe":
        assert re.search(r"print_info: n_expert\s+= 4$", log, re.MULTILINE)


READ = {"name": "Read", "description": "Read a file",
        "input_schema": {"type": "object", "additionalProperties": False, "required": ["file_path"],
                         "properties": {"file_path": {"type": "string"}, "offset": {"type": "number"}}}}
BASH = {"name": "Bash", "description": "Run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
GET_TIME = {"name": "get_time", "description": "The time",
            "input_schema": {"type": "object", "required": ["timezone"],
                             "properties": {"timezone": {"type": "string", "enum": ["UTC", "Europe/Berlin"]}}}}


def test_the_scripted_model_calls_tools_and_answers_as_its_template_asks(tmp_path: Path, llama_server: Path) -> None:
    """The demo model on the real engine, with the tools the clients send: a well-formed call where its script says
    so (tool_choice auto, and any), the plain answer after the result, and the answer wherever else."""
    model = write_scripted_model(tmp_path / "scripted.gguf", n_ctx_train=131072, name="tiny-llama")
    with serve(llama_server, model, ["-c", "8192", "--jinja"]) as server:
        def messages(body: dict) -> dict:
            reply = httpx.post(f"{server.url}/v1/messages", json={"model": "m", "max_tokens": 256, **body}, timeout=60)
            assert reply.status_code == 200, reply.text
            return reply.json()

        asked = [{"role": "user", "content": [{"type": "text", "text": "Read notes.txt, then say its first word"}]}]
        first = messages({"system": "You are a coding agent.", "tools": [BASH, READ], "messages": asked})
        (use,) = first["content"]
        assert (use["type"], use["name"], use["input"], first["stop_reason"]) == (
            "tool_use", "Read", {"file_path": "notes.txt"}, "tool_use")
        result = [{"type": "tool_result", "tool_use_id": use["id"], "content": "Bananas are yellow."},
                  {"type": "text", "text": "<system-reminder>a client's note beside the result</system-reminder>"}]
        second = messages({"tools": [BASH, READ],
                           "messages": [*asked, {"role": "assistant", "content": first["content"]},
                                        {"role": "user", "content": result}]})
        assert second["content"] == [{"type": "text", "text": "Done."}] and second["stop_reason"] == "end_turn"
        forced = messages({"tools": [GET_TIME], "tool_choice": {"type": "any"}, "temperature": 0,
                           "messages": [{"role": "user", "content": "What time is it in UTC?"}]})
        assert [(part["name"], part["input"]) for part in forced["content"]] == [("get_time", {"timezone": "UTC"})]
        # Offered tools the script does not know (OpenClaw's), or Read without notes.txt asked for: the answer.
        other = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 64, "stream": False,
            "tools": [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]}).json()
        assert other["choices"][0]["message"]["content"] == "Done." and other["choices"][0]["finish_reason"] == "stop"
        plain = messages({"tools": [READ], "messages": [{"role": "user", "content": "Say hello in five words."}]})
        assert plain["content"] == [{"type": "text", "text": "Done."}]
