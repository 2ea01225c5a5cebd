"""The README's demo box with the real agent clients: the whole loop, tool calls included.

The box is `controller demo`'s: its fleet entry (``lab.demo.write_fleet``), the lab's catalog and its scripted model
(``lab.site.DEMO_MODELS``: a chat template and weights that make a tool-offering turn a well-formed call), provisioned
over SSH into a systemd container (a test's own, on a free port, so a running demo box is left alone). Then, with
exactly what ``controller clients --json`` prints: the pinned Claude Code reads a file with its Read tool and the
result goes back to the box; the pinned OpenClaw (on the pinned Node 24) completes a turn through the merged provider
entry; and ``controller certify`` checks the tool-call round trip and passes.
"""

from __future__ import annotations

import json
import subprocess
from functools import partial
from pathlib import Path

import pytest

from lab import demo
from lab import openclaw as lab_openclaw
from lab.claude_code import claude_binary, claude_env
from lab.fileserver import FileServer
from lab.site import DEMO_MODELS
from lab.target import free_port
from tests.cli import run_controller

pytestmark = [pytest.mark.podman, pytest.mark.engine, pytest.mark.slow]

controller = partial(run_controller, timeout=900)
MODEL = DEMO_MODELS[0].id
NOTES = "Bananas are yellow.\nThe second line.\n"
READ_PROMPT = "Read the file notes.txt and tell me its first word"


@pytest.fixture(scope="module")
def demo_box(tmp_path_factory, lab_site, systemd_target) -> Path:
    """The demo box, provisioned as `controller demo` provisions it; yields its fleet file."""
    root, catalog = lab_site
    folder = tmp_path_factory.mktemp("demo")
    with FileServer(root) as server:
        fleet_path = demo.write_fleet(folder, systemd_target, server, catalog, base_port=free_port())
        done = controller("provision", demo.DEMO_BOX, "--fleet", str(fleet_path), "--json")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        yield fleet_path


@pytest.fixture(scope="module")
def clients(demo_box) -> dict:
    done = controller("clients", demo.DEMO_BOX, "--fleet", str(demo_box), "--json")
    assert done.returncode == 0 and done.stderr == "", done.stderr  # planned for both clients: no warning
    answer = json.loads(done.stdout)
    assert answer["services"][0]["ctx"] >= 65536 and answer["services"][0]["warnings"] == []
    return answer


def _blocks(events: list[dict], role: str, kind: str) -> list[dict]:
    return [block for event in events if event.get("type") == role
            for block in event["message"]["content"] if isinstance(block, dict) and block.get("type") == kind]


def test_claude_code_uses_a_tool_on_the_demo_box(clients, tmp_path):
    """`claude -p ... --allowedTools Read` in a project holding notes.txt: the served model calls Read, Claude Code
    runs it and sends the result back, and the model answers: one turn, two requests, completed."""
    service = clients["services"][0]
    work = tmp_path / "project"
    work.mkdir()
    (work / "notes.txt").write_text(NOTES)
    done = subprocess.run([str(claude_binary()), "-p", READ_PROMPT, "--allowedTools", "Read",
                           "--output-format", "stream-json", "--verbose"], check=False, cwd=work,
                          env=claude_env(service["claude_code"]["env"], home=tmp_path / "home"),
                          capture_output=True, text=True, timeout=600)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and events, done.stdout[-3000:] + done.stderr[-3000:]
    (use,) = _blocks(events, "assistant", "tool_use")
    assert use["name"] == "Read" and use["input"] == {"file_path": "notes.txt"}
    (answer,) = _blocks(events, "user", "tool_result")
    assert answer["tool_use_id"] == use["id"] and not answer.get("is_error")
    assert "Bananas are yellow." in json.dumps(answer["content"])
    # The model answers in text only once a tool result is in the conversation it is sent (with Read offered and
    # notes.txt asked for, it would call Read again): the answer proves the result went back to the box.
    assert [block["text"] for block in _blocks(events, "assistant", "text")] == ["Done."]
    result = events[-1]
    assert result["type"] == "result" and result["is_error"] is False and result["subtype"] == "success", result
    assert result["terminal_reason"] == "completed" and result["num_turns"] == 2 and result["result"] == "Done."
    assert list(result["modelUsage"]) == [MODEL] and result["modelUsage"][MODEL]["contextWindow"] == service["ctx"]
    assert result["usage"]["input_tokens"] + result["usage"]["cache_read_input_tokens"] > 16384  # its whole prompt


def test_openclaw_completes_a_turn_on_the_demo_box(clients, tmp_path):
    """The pinned OpenClaw on Node 24: the provider entry merged into the user's config (which it validates), then
    `openclaw agent exec ... --json` against the box."""
    service = clients["services"][0]
    entry = service["openclaw"]
    (model,) = entry["provider"]["models"]
    assert model["compat"] == {"supportsTools": True, "toolSchemaProfile": "llamacpp"}
    work = tmp_path / "project"
    work.mkdir()
    turn = lab_openclaw.run_turn(entry, "Say hello", work, tmp_path / "home",
                                 user_config="// the user's own settings\n{ update: { checkOnStart: false }, }\n")
    assert turn["validate"][0] == 0, turn["validate"][1]
    merged = json.loads(turn["config"])
    assert merged["update"] == {"checkOnStart": False} and merged["models"]["providers"][entry["provider_id"]]
    result = turn["result"]
    # OpenClaw exits 0 after a turn; on a busy machine it has printed a finished turn's envelope and then not exited
    # (lab/openclaw.py EXIT_GRACE_S): the turn is judged by that envelope, which must be complete and ok.
    assert (turn["returncode"] == 0 or turn["lingered"]) and result is not None, turn["stdout"] + turn["stderr"]
    assert result["ok"] is True and result["status"] == "ok", result
    assert (result["provider"], result["model"]) == (entry["provider_id"], MODEL)
    assert result["final"] == "Done." and result["assistantTurns"] == 1
    # OpenClaw's first request is its system prompt and tools, ~23k tokens: within the planned context.
    assert 16384 < result["usage"]["input"] < service["ctx"], result["usage"]


def test_certify_checks_the_tool_call_round_trip_on_the_demo_box(demo_box):
    done = controller("certify", demo.DEMO_BOX, "--fleet", str(demo_box), "--json")
    answer = json.loads(done.stdout) if done.stdout.strip() else {}
    assert done.returncode == 0 and answer.get("passed") is True, done.stdout[-3000:] + done.stderr[-3000:]
    (endpoint,) = [check for check in answer["checks"] if check["name"].startswith("endpoint")]
    assert endpoint["passed"] and "a tool call went out as 'get_time' and its result came back" in endpoint["detail"]
    assert not [entry for entry in answer["not_checked"] if "tool call" in entry["name"]], answer["not_checked"]
