"""The environment and cache folder the tests give the real OpenClaw, the Node it runs on, and how a turn's process is
waited for (lab.openclaw._agent_exec, with a stand-in script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from lab.openclaw import OPENCLAW_VERSION, install_dir, node_home, node_version, openclaw_env


def test_the_pinned_node_is_one_openclaw_runs_on():
    major, minor = (int(part) for part in node_version().split(".")[:2])
    assert (major, minor) >= (24, 16) and major != 25  # OpenClaw 2026.9.x: node >=24.16.0 <25 || >=26.1.0
    npm = node_home() / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"
    assert subprocess.run([str(node_home() / "bin" / "node"), str(npm), "--version"], check=True,
                          capture_output=True, text=True).stdout.strip()


def test_openclaw_env_drops_the_callers_settings_and_uses_a_private_home(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCLAW_CONFIG_PATH", "/somewhere/else.json")
    monkeypatch.setenv("OPENCLAW_STATE_DIR", "/somewhere/state")
    monkeypatch.setenv("OPENAI_API_KEY", "someone-elses")
    env = openclaw_env(tmp_path / "home")
    assert not {"OPENCLAW_CONFIG_PATH", "OPENCLAW_STATE_DIR", "OPENAI_API_KEY"} & set(env)
    assert env["HOME"] == str(tmp_path / "home") and (tmp_path / "home").is_dir()
    assert env["PATH"].split(":")[0] == str(node_home() / "bin")  # `#!/usr/bin/env node` finds Node 24
    assert env["OPENCLAW_NO_AUTO_UPDATE"] == "1"


def test_each_version_has_its_own_cache_folder():
    assert install_dir().name == f"{OPENCLAW_VERSION}-node{node_version()}"
    assert install_dir("2026.9.1") != install_dir()


def _fake_openclaw(tmp_path, body: str) -> list[str]:
    script = tmp_path / "openclaw.py"
    script.write_text("import json, sys, time\n" + body)
    return [sys.executable, str(script)]


def test_a_turn_that_answers_and_exits_keeps_its_status(tmp_path):
    from lab.openclaw import _agent_exec

    argv = _fake_openclaw(tmp_path, "print(json.dumps({'ok': True}))\nsys.exit(3)\n")
    stdout, _, returncode, lingered = _agent_exec(argv, tmp_path, dict(os.environ))
    assert json.loads(stdout) == {"ok": True} and returncode == 3 and lingered is False


def test_an_openclaw_that_answers_and_does_not_exit_is_stopped_as_lingered(tmp_path, monkeypatch):
    import lab.openclaw as lab_openclaw

    monkeypatch.setattr(lab_openclaw, "EXIT_GRACE_S", 1)
    argv = _fake_openclaw(tmp_path, "print(json.dumps({'ok': True}), flush=True)\ntime.sleep(300)\n")
    started = time.monotonic()
    stdout, _, returncode, lingered = lab_openclaw._agent_exec(argv, tmp_path, dict(os.environ))
    assert lingered is True and returncode is None and json.loads(stdout) == {"ok": True}
    assert time.monotonic() - started < 30


def test_an_openclaw_that_never_answers_times_out(tmp_path, monkeypatch):
    import lab.openclaw as lab_openclaw

    monkeypatch.setattr(lab_openclaw, "TURN_TIMEOUT_S", -58)  # a deadline two seconds away
    argv = _fake_openclaw(tmp_path, "print('{\"ok\":', flush=True)\ntime.sleep(300)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        lab_openclaw._agent_exec(argv, tmp_path, dict(os.environ))
