"""The environment the tests give the real Claude Code: only what the caller passes points it anywhere."""

from __future__ import annotations

from lab.claude_code import CLAUDE_CODE_VERSION, claude_env, install_dir


def test_claude_env_drops_the_callers_client_settings_and_uses_a_private_home(tmp_path, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "someone-elses")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://elsewhere")
    monkeypatch.setenv("CLAUDE_CODE_USE_BEDROCK", "1")
    env = claude_env({"ANTHROPIC_BASE_URL": "http://127.0.0.1:1", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": 64},
                     home=tmp_path / "home")
    assert "ANTHROPIC_API_KEY" not in env and "CLAUDE_CODE_USE_BEDROCK" not in env
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:1" and env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "64"
    assert env["HOME"] == str(tmp_path / "home") and (tmp_path / "home").is_dir()
    assert env["DISABLE_AUTOUPDATER"] == "1" and env["PATH"]


def test_each_version_has_its_own_cache_folder():
    assert install_dir().name == CLAUDE_CODE_VERSION and install_dir("2.1.1") != install_dir()
