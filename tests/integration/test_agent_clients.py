"""The real Claude Code (the pinned npm release) against the planned server command line.

The box is a loopback box planned for the demo model with ``agents: [claude-code, openclaw]``; its
service runs the planned llama-server command line. Claude Code gets exactly the environment
``controller clients --json`` prints. The real OpenClaw, and Claude Code calling a tool, run against the
provisioned demo box in test_demo_agents.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import string
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from controller.model.catalog import load_catalog
from controller.model.fleet import load_fleet
from controller.model.profile import Cpu, HardwareProfile, OsInfo
from controller.stages.planner import plan_box
from lab.agent_turn import run_turn
from lab.site import DEMO_MODELS, MODEL_REPO
from lab.target import free_port
from tests.cli import REPO, run_controller

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MODEL = DEMO_MODELS[0].id
KEY = "agent-clients-test-key-0123456789"
PROMPT = "Say hello in five words."


@pytest.fixture(scope="module")
def agent_box(tmp_path_factory, lab_site) -> Path:
    """A fleet with one loopback box serving the demo model to both clients, planned and rendered (plans/)."""
    root, catalog = lab_site
    folder = tmp_path_factory.mktemp("agents")
    key = folder / "api.key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    fleet_path = folder / "fleet.yml"
    fleet_path.write_text(yaml.safe_dump({"catalogs": [str(catalog)], "boxes": {"agents": {
        "address": "127.0.0.1", "transport": "local", "base_port": free_port(), "model_dir": str(root / MODEL_REPO),
        "api_key": {"file": str(key)}, "models": [{"id": MODEL, "agents": ["claude-code", "openclaw"]}]}}}))
    fleet = load_fleet(fleet_path)
    box = fleet.box("agents")
    profile = HardwareProfile(cpu=Cpu(cores=2, threads=2), memory_mib=8192, os=OsInfo(family="linux"))
    plan = plan_box(box, profile, load_catalog(fleet.catalogs))
    assert plan.fits and plan.services[0].ctx >= 65536, plan
    (folder / "inventory" / "plans").mkdir(parents=True)
    (folder / "inventory" / "plans" / "agents.json").write_text(plan.model_dump_json())
    return fleet_path


def _clients(fleet_path: Path) -> dict:
    result = run_controller("clients", "agents", "--fleet", str(fleet_path), "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _assert_completed(turn: dict) -> None:
    result = turn["result"]
    assert turn["returncode"] == 0 and result is not None, turn["stdout"] + turn["stderr"]
    assert result["is_error"] is False and result["subtype"] == "success", result
    assert result["terminal_reason"] == "completed", result
    assert list(result["modelUsage"]) == [MODEL], result["modelUsage"]  # every request named the served model
    ctx = turn["clients"]["services"][0]["ctx"]
    assert result["modelUsage"][MODEL]["contextWindow"] == ctx  # Claude Code budgets with the planned context
    # The server saw Claude Code's request: its whole system prompt and tools, well past 2048 tokens.
    prompts = [int(n) for n in re.findall(rf"new prompt, n_ctx_slot = {ctx}, .*task\.n_tokens = (\d+)",
                                          turn["server_log"])]
    assert prompts and max(prompts) > 8192, turn["server_log"][-3000:]


def test_claude_code_completes_a_turn_with_the_generated_environment(agent_box, llama_server):
    _assert_completed(run_turn(agent_box, "agents", llama_server, PROMPT))


@pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"), reason="a network namespace needs root")
def test_claude_code_needs_nothing_beyond_the_box(agent_box, llama_server):
    """The same turn inside a network namespace that has only loopback: nothing else is contacted."""
    script = "ip link set lo up && exec " + shlex.join(map(str, [sys.executable, "-m", "lab.agent_turn", agent_box,
                                                                 "agents", llama_server, PROMPT]))
    done = subprocess.run(["unshare", "--net", "sh", "-c", script], check=False, cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    turn = json.loads(done.stdout)
    _assert_completed(turn)
    links = subprocess.run(["unshare", "--net", "ip", "-o", "link"], capture_output=True, text=True, check=True)
    assert [line.split(":")[1].strip() for line in links.stdout.splitlines()] == ["lo"]


def test_a_prompt_beyond_the_planned_context_gets_the_engines_error(agent_box, llama_server):
    """Claude Code shows the engine's refusal of a prompt larger than the planned context."""
    ctx = _clients(agent_box)["services"][0]["ctx"]
    rng = random.Random(7)  # random characters: about one token each with the demo model's small vocabulary
    prompt = "".join(rng.choice(string.ascii_letters + string.digits + " ") for _ in range(ctx + 24000))
    turn = run_turn(agent_box, "agents", llama_server, prompt)
    result = turn["result"]
    assert result is not None, turn["stdout"] + turn["stderr"]
    assert result["is_error"] is True and result["api_error_status"] == 400, result
    assert result["terminal_reason"] == "prompt_too_long", result
    assert f"exceeds the available context size ({ctx} tokens)" in result["result"]
    assert "exceeds the available context size" in turn["server_log"]
