"""win_llama_engine's preflight trusts a checksum list only over https (run by Ansible on localhost)."""

import pytest

from tests.unit.windows.ansible_local import run_playbook

pytestmark = pytest.mark.slow

ZIP = "https://mirror.example/llama-upstream-02182fc-windows-x86_64-cuda12.8-sm70.zip"


def preflight(tmp_path, pack: dict):
    plays = [{"name": "Preflight", "hosts": "localhost", "gather_facts": False, "tasks": [
        {"name": "Run the preflight", "ansible.builtin.include_role": {"name": "win_llama_engine",
                                                                        "tasks_from": "preflight"}}]}]
    return run_playbook(tmp_path, plays, {"win_llama_engine_packs": [pack]})


@pytest.mark.parametrize(("sums", "accepted"), [
    ("https://mirror.example/SHA256SUMS", True),
    ("http://mirror.example/SHA256SUMS", False),
])
def test_a_checksum_list_is_trusted_only_over_https(tmp_path, sums, accepted):
    result = preflight(tmp_path, {"name": "upstream", "version": "02182fc", "url": ZIP, "sha256sums_url": sums})
    assert (result.returncode == 0) == accepted, result.stdout + result.stderr
    if not accepted:
        assert "the https address of a SHA256SUMS" in result.stdout


def test_a_pinned_sha256_needs_no_checksum_list(tmp_path):
    result = preflight(tmp_path, {"name": "upstream", "version": "02182fc", "url": ZIP.replace("https", "http"),
                                  "sha256": "ab" * 32})
    assert result.returncode == 0, result.stdout + result.stderr
