"""The real CPU llama-server loads each generated architecture and answers both chat APIs."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from lab.llama_server import serve
from lab.tinymodels import ARCHS, write_model

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
