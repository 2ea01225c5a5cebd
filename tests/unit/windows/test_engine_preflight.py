"""llama_engine's preflight on Windows trusts a checksum list only over https (run by Ansible on localhost)."""

import pytest

from tests.unit.windows.ansible_local import run_playbook

pytestmark = pytest.mark.slow

ZIP = "https://mirror.example/llama-upstream-02182fc-windows-x86_64-cuda12.8-sm70.zip"


def preflight(tmp_path, *packs: dict):
    plays = [{"name": "Preflight", "hosts": "localhost", "gather_facts": False, "tasks": [
        {"name": "Run the preflight", "ansible.builtin.include_role": {"name": "v100box.llm.llama_engine",
                                                                        "tasks_from": "preflight"}}]}]
    return run_playbook(tmp_path, plays, {"llama_engine_packs": list(packs)})


@pytest.mark.parametrize(("sums", "accepted"), [
    ("https://mirror.example/SHA256SUMS", True),
    ("http://mirror.example/SHA256SUMS", False),
])
def test_a_checksum_list_is_trusted_only_over_https(tmp_path, sums, accepted):
    result = preflight(tmp_path, {"name": "upstream", "version": "02182fc", "url": ZIP, "sha256": "",
                                  "sha256sums_url": sums, "nccl": False})
    assert (result.returncode == 0) == accepted, result.stdout + result.stderr
    if not accepted:
        assert "the https address of a SHA256SUMS" in result.stdout


def test_a_pinned_sha256_needs_no_checksum_list(tmp_path):
    result = preflight(tmp_path, {"name": "upstream", "version": "02182fc", "url": ZIP.replace("https", "http"),
                                  "sha256": "ab" * 32, "sha256sums_url": ""})
    assert result.returncode == 0, result.stdout + result.stderr


def test_windows_fetches_packs_over_http_only(tmp_path):
    # Linux also installs file:// packs (the tests'); win_get_url cannot.
    result = preflight(tmp_path, {"name": "upstream", "version": "02182fc", "url": "file:///srv/pack.zip",
                                  "sha256": "ab" * 32})
    assert result.returncode != 0 and "an http(s) url" in result.stdout


def test_one_version_listed_twice_is_refused(tmp_path):
    pack = {"name": "upstream", "version": "02182fc", "url": ZIP, "sha256": "ab" * 32}
    result = preflight(tmp_path, pack, pack)
    assert result.returncode != 0 and "lists one name and version twice" in result.stdout
