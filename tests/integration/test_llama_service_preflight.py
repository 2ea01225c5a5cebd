"""llama_service's preflight, run by ansible-playbook on this machine (it only asserts, so no target is
needed): hand-written inventories get the same exposure and key rules as the controller's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = """
- hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Run the preflight only
      ansible.builtin.include_role:
        name: v100box.llm.llama_service
        tasks_from: preflight.yml
"""
KEY = "preflight-key-0123456789"


def instance(*args: str, **extra: object) -> dict[str, object]:
    return {"name": "llama-a", "model": "tiny", "engine": "cpu", "port": 18011,
            "args": ["--model", "/m.gguf", "--port", "18011", *args], **extra}


def preflight(tmp_path: Path, **variables: object) -> subprocess.CompletedProcess[str]:
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    (tmp_path / "vars.yml").write_text(yaml.safe_dump(variables))
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(ROOT), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "False", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "False"}
    return subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), str(tmp_path / "play.yml"),
                           "-e", f"@{tmp_path / 'vars.yml'}", "-e", f"ansible_python_interpreter={sys.executable}"],
                          env=env, capture_output=True, text=True, check=False, timeout=120)


def test_loopback_without_a_key_passes(tmp_path):
    done = preflight(tmp_path, llama_service_instances=[instance("--host", "127.0.0.1")])
    assert done.returncode == 0, done.stdout[-3000:]


@pytest.mark.parametrize("variables", [
    # The reproduced hole: the arguments bind everywhere while llama_service_bind says loopback.
    {"llama_service_instances": [instance("--host", "0.0.0.0")]},
    {"llama_service_instances": [instance("--host=0.0.0.0")]},
    {"llama_service_instances": [instance(env={"LLAMA_ARG_HOST": "0.0.0.0"})]},
], ids=["host-arg", "host-equals", "host-env"])
def test_arguments_that_bind_elsewhere_than_llama_service_bind_are_refused(tmp_path, variables):
    done = preflight(tmp_path, **variables)
    assert done.returncode != 0
    assert "llama_service_instances entry llama-a: its args bind" in done.stdout
    assert "but llama_service_bind is 127.0.0.1" in done.stdout


def test_binding_beyond_loopback_needs_a_key_and_allowed_networks(tmp_path):
    exposed = {"llama_service_bind": "0.0.0.0", "llama_service_instances": [instance("--host", "0.0.0.0")]}
    for variables in ({}, {"llama_service_api_key": KEY}, {"llama_service_allow_from": ["10.0.0.0/8"]}):
        done = preflight(tmp_path, **exposed, **variables)
        assert done.returncode != 0, variables
        assert "llama_service_bind is 0.0.0.0, which other machines can reach" in done.stdout
    done = preflight(tmp_path, **exposed, llama_service_api_key=KEY, llama_service_allow_from=["10.0.0.0/8"])
    assert done.returncode == 0, done.stdout[-3000:]


def test_key_on_the_command_line_or_in_the_environment_is_refused(tmp_path):
    for bad in (instance("--api-key", KEY), instance("--api-key-file", "/k"), instance(env={"LLAMA_API_KEY": KEY})):
        done = preflight(tmp_path, llama_service_instances=[bad])
        assert done.returncode != 0 and "never pass --api-key, --api-key-file" in done.stdout


@pytest.mark.parametrize("key", ["trailing-space-key-0123 ", "a key with spaces 0123", "#comment-key-0123456", "short"])
def test_keys_a_server_would_not_match_are_refused(tmp_path, key):
    done = preflight(tmp_path, llama_service_api_key=key, llama_service_instances=[instance()])
    assert done.returncode != 0
    assert "use 16 to 256 printable ASCII characters with no spaces" in done.stdout
    assert key.strip() not in done.stdout


def test_keys_systemd_would_rewrite_are_accepted(tmp_path):
    done = preflight(tmp_path, llama_service_api_key='odd\\key"with\'quotes$%-0123', llama_service_instances=[instance()])
    assert done.returncode == 0, done.stdout[-3000:]
