"""One real Claude Code turn against a planned service, with exactly the environment ``controller clients`` gives.

``python -m lab.agent_turn FLEET BOX SERVER PROMPT`` runs the box's first planned service with the
local llama-server (the planned command line, the box's key file), runs ``controller clients BOX
--fleet FLEET --json``, runs ``claude -p PROMPT --output-format json`` with that environment and
prints one JSON object: ``{"clients": ..., "result": <claude's JSON or null>, "stdout", "stderr",
"returncode", "server_log"}``. The tests run it as is and inside a network namespace with only
loopback (``unshare --net``), so everything it needs starts inside the namespace.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from controller.inventory import Inventory
from controller.model.fleet import load_fleet
from lab.claude_code import claude_binary, claude_env
from lab.llama_server import start, stop

CLAUDE_TIMEOUT_S = 300


def run_turn(fleet_path: Path, box_name: str, server: Path, prompt: str) -> dict:
    fleet = load_fleet(fleet_path)
    box = fleet.box(box_name)
    plan = Inventory.beside(fleet_path).plan(box.name)
    service = plan.services[0]
    clients = subprocess.run([sys.executable, "-m", "controller", "clients", box_name, "--fleet", str(fleet_path),
                              "--json", "--for", "claude-code"], capture_output=True, text=True, check=True)
    answer = json.loads(clients.stdout)
    env = answer["services"][0]["claude_code"]["env"]
    binary = claude_binary()
    with tempfile.TemporaryDirectory(prefix="agent-turn-") as tmp:
        log = Path(tmp) / "server.log"
        process = start(server, [*service.args, "--api-key-file", str(box.api_key.file)], log,
                        env["ANTHROPIC_BASE_URL"])
        try:
            work = Path(tmp) / "work"
            work.mkdir()
            turn = subprocess.run([str(binary), "-p", prompt, "--output-format", "json"], check=False, cwd=work,
                                  env=claude_env(env, home=Path(tmp) / "home"), capture_output=True, text=True,
                                  timeout=CLAUDE_TIMEOUT_S)
        finally:
            stop(process)
        try:
            result = json.loads(turn.stdout)
        except ValueError:
            result = None
        return {"clients": answer, "result": result, "stdout": turn.stdout[-4000:], "stderr": turn.stderr[-4000:],
                "returncode": turn.returncode, "server_log": log.read_text(errors="replace")}


if __name__ == "__main__":
    fleet_arg, box_arg, server_arg, prompt_arg = sys.argv[1:5]
    print(json.dumps(run_turn(Path(fleet_arg), box_arg, Path(server_arg), prompt_arg)))
