"""llama_api_check's certification checks (certify: true) against the real CPU llama-server, run as Ansible runs a
module, and through the llama_verify role; a server that answers badly turns into details, never a crash."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lab import tinymodels
from lab.llama_server import serve
from tests.unit.plugins.test_llama_api_check import KEY, run_module
from tests.unit.windows.ansible_local import run_playbook

pytestmark = pytest.mark.engine

# The scripted model (the demo box's, lab/tinymodels.py): offered certify's get_time it calls it, after the tool
# result it answers "Done.", and so does every plain turn, so the streams carry a reply every time. (A model of
# random weights stopped at the first token now and then: an Anthropic stream of two events.)
SERVER_ARGS = ["--alias", "tiny", "--api-key", KEY, "-c", "2048", "-np", "1", "--jinja"]


@pytest.fixture(scope="module")
def tool_server(llama_server, tmp_path_factory):
    model = tinymodels.write_scripted_model(tmp_path_factory.mktemp("m") / "tools.gguf")
    with serve(llama_server, model, SERVER_ARGS) as running:
        yield running


def test_certify_makes_a_tool_call_round_trip_streams_both_apis_and_reads_the_timings(tool_server, tmp_path):
    result = run_module(tmp_path, base_url=tool_server.url, model="tiny", api_key=KEY, max_tokens=8, certify=True)
    assert not result.get("failed"), result
    tool = result["tool_call"]
    assert tool["ok"] and tool["tool_use"] and tool["tool_name"] == "get_time", tool
    assert tool["stop_reason"] == "tool_use" and tool["final_stop_reason"] in ("end_turn", "max_tokens"), tool
    openai, anthropic = result["streams"]["openai"], result["streams"]["anthropic"]
    assert openai["ok"] and openai["done"] and openai["chunks"] > 1, openai
    assert anthropic["ok"] and anthropic["message_stop"] and anthropic["events"] > 4, anthropic
    speed = result["throughput"]
    # ignore_eos: exactly the tokens asked for; cache_prompt false: the whole fixed prompt, also the second time.
    assert speed["predicted_tokens"] == 64 and speed["prompt_tokens"] > 200, speed
    assert speed["prompt_per_second"] > 0 and speed["predicted_per_second"] > 0, speed
    again = run_module(tmp_path, base_url=tool_server.url, model="tiny", api_key=KEY, max_tokens=8, certify=True,
                       throughput_max_tokens=16)
    assert again["throughput"]["prompt_tokens"] == speed["prompt_tokens"]
    assert again["throughput"]["predicted_tokens"] == 16 and "(median of 3 runs)" in again["throughput"]["detail"]
    assert KEY not in json.dumps(result)


def test_without_certify_the_answer_is_as_before(tool_server, tmp_path):
    result = run_module(tmp_path, base_url=tool_server.url, model="tiny", api_key=KEY, max_tokens=2)
    assert not result.get("failed"), result
    assert not {"tool_call", "streams", "throughput"} & set(result)


def test_a_chat_template_without_tool_calls_is_a_failed_field_not_a_failed_module(llama_server, tmp_path):
    # The tiny model's own ChatML template renders no tools: the server answers text, never a tool_use block.
    model = tinymodels.write_model(tmp_path / "chatml.gguf", "llama", file_type="q8_0")
    with serve(llama_server, model, SERVER_ARGS) as running:
        result = run_module(tmp_path, base_url=running.url, model="tiny", api_key=KEY, max_tokens=4, certify=True)
    assert not result.get("failed"), result
    tool = result["tool_call"]
    assert tool["ok"] is False and tool["tool_use"] is False and tool["tool_name"] is None, tool
    assert "had no tool_use block" in tool["detail"] and "may not support tool calls" in tool["detail"]
    assert result["streams"]["openai"]["ok"] and result["streams"]["anthropic"]["ok"]


def test_certify_needs_the_chat_turns_and_a_request(tmp_path):
    result = run_module(tmp_path, base_url="http://127.0.0.1:9", model="tiny", chat=False, certify=True)
    assert result["failed"] and result["msg"] == "certify needs chat: true (the certification's checks are chat turns)"
    result = run_module(tmp_path, base_url="http://127.0.0.1:9", model="tiny", certify=True, throughput_runs=0)
    assert result["failed"] and result["msg"] == "throughput_runs must be at least 1, not 0"


class BadServer(BaseHTTPRequestHandler):
    """Answers the basic checks as llama-server does, and the certification's requests badly: the tool call with
    the engine's parse error, a chat stream cut before [DONE], a messages stream that stalls, no timings."""

    def log_message(self, *args):
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._json(200, {"status": "ok"} if self.path == "/health" else {"data": [{"id": "tiny"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"object": "chat.completion.chunk"}\n\n')
            self.wfile.flush()
            if self.path == "/v1/messages":
                time.sleep(4)  # past the module's timeout of 2 s
            return
        if self.path == "/v1/messages" and "tools" in body:
            self._json(500, {"error": {"code": 500, "type": "server_error", "message":
                                       "The model produced output that does not match the expected peg-native format"}})
        elif self.path == "/v1/messages":
            self._json(200, {"type": "message", "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
                             "usage": {"output_tokens": 1}})
        else:
            self._json(200, {"object": "chat.completion", "choices": [{"message": {"content": "hi"}}],
                             "usage": {"completion_tokens": 1}})


@pytest.fixture
def bad_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), BadServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_bad_answers_become_details(bad_server, tmp_path):
    started = time.monotonic()
    result = run_module(tmp_path, base_url=bad_server, model="tiny", max_tokens=2, timeout=2, certify=True)
    assert not result.get("failed"), result
    assert time.monotonic() - started < 30
    tool = result["tool_call"]
    assert tool == {"ok": False, "tool_use": False, "tool_name": None, "stop_reason": None, "final_stop_reason": None,
                    "detail": "the request with a tool failed: /v1/messages answered HTTP 500: The model produced "
                              "output that does not match the expected peg-native format"}
    assert result["streams"]["openai"] == {"ok": False, "chunks": 1, "done": False,
                                           "detail": "the stream ended after 1 chunks without data: [DONE]"}
    anthropic = result["streams"]["anthropic"]
    assert anthropic["ok"] is False and anthropic["message_stop"] is False and anthropic["events"] == 1
    assert anthropic["detail"].startswith("after 1 events: /v1/messages stopped streaming"), anthropic
    assert result["throughput"] == {
        "prompt_tokens": None, "prompt_per_second": None, "predicted_tokens": None, "predicted_per_second": None,
        "detail": "the server's reply has no timings (llama-server reports them with each reply)"}


@pytest.mark.slow
def test_the_verify_role_records_the_certification(tool_server, tmp_path):
    plays = [{"name": "Verify", "hosts": "localhost", "gather_facts": False, "roles": [{"role": "v100box.llm.llama_verify"}]}]
    extra = {"llama_verify_instances": [{"name": "tiny", "model": "tiny", "port": tool_server.port}],
             "llama_verify_api_key": KEY, "llama_verify_certify": True, "llama_verify_max_tokens": 4}
    done = run_playbook(tmp_path, plays, extra, json_output=True, windows=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    answers = json.loads(done.stdout[done.stdout.index("{"):])["global_custom_stats"]["llama_verify"]["localhost"]
    recorded = answers["tiny"]
    assert recorded["tool_call"]["ok"] and recorded["tool_call"]["tool_name"] == "get_time"
    assert recorded["streams"]["openai"]["ok"] and recorded["streams"]["anthropic"]["ok"]
    assert recorded["throughput"]["predicted_tokens"] == 64 and recorded["auth"]["required"] is True
    # "false" as `-e llama_verify_certify=false` hands it: a string, still false.
    plain = run_playbook(tmp_path, plays, dict(extra, llama_verify_certify="false"), json_output=True, windows=False)
    assert plain.returncode == 0, plain.stdout[-3000:]
    recorded = json.loads(plain.stdout[plain.stdout.index("{"):])["global_custom_stats"]["llama_verify"]["localhost"]
    assert set(recorded["tiny"]) == {"model", "port", "health", "served_ids", "openai", "anthropic", "auth"}
    # No key in the inventory: the module reads the server's key file on the host (<key_dir>/<name>.key).
    key_dir = tmp_path / "keys"
    key_dir.mkdir()
    (key_dir / "tiny.key").write_text(KEY + "\n")
    from_file = run_playbook(tmp_path, plays, dict(extra, llama_verify_certify=False, llama_verify_api_key="",
                                                   llama_verify_key_dir=str(key_dir)), json_output=True, windows=False)
    assert from_file.returncode == 0, from_file.stdout[-3000:]
    assert KEY not in from_file.stdout
    recorded = json.loads(from_file.stdout[from_file.stdout.index("{"):])["global_custom_stats"]["llama_verify"]["localhost"]
    assert recorded["tiny"]["auth"] == {"required": True, "anonymous_status": 401, "wrong_key_status": 401}


def test_the_verify_role_checks_the_servers_of_every_host_in_one_task(tool_server, tmp_path):
    # Two boxes of one run whose servers differ (here by name): each check is one task for both, not a copy of the
    # checks per box, which the linear strategy would run one box after the other.
    plays = [{"name": "Verify", "hosts": "all", "gather_facts": False, "roles": [{"role": "v100box.llm.llama_verify"}]}]
    hosts = {box: {"llama_verify_instances": [{"name": f"tiny-{box}", "model": "tiny", "port": tool_server.port}]}
             for box in ("box-a", "box-b")}
    done = run_playbook(tmp_path, plays, {"llama_verify_api_key": KEY, "llama_verify_max_tokens": 4},
                        json_output=True, windows=False, hosts=hosts)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout[done.stdout.index("{"):])
    checks = [task for task in report["plays"][0]["tasks"] if "Check health" in task["task"]["name"]]
    assert [sorted(task["hosts"]) for task in checks] == [["box-a", "box-b"]], [task["task"]["name"] for task in checks]
    answers = report["global_custom_stats"]["llama_verify"]
    assert {box: sorted(answers[box]) for box in hosts} == {"box-a": ["tiny-box-a"], "box-b": ["tiny-box-b"]}
    assert answers["box-b"]["tiny-box-b"]["auth"]["required"] is True
