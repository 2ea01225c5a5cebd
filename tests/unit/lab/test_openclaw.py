"""The environment and cache folder the tests give the real OpenClaw, and the Node it runs on."""

from __future__ import annotations

import subprocess

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
