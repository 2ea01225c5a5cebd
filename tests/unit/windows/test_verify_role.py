"""roles/llama_verify publishes under one key on both OSes and tells Windows apart even when verify.yml gathered
no facts (run by Ansible on localhost; no server is contacted)."""

import json

import pytest

from tests.unit.windows.ansible_local import role_vars, run_playbook

pytestmark = pytest.mark.slow


def play(**extra_vars) -> list[dict]:
    return [{"name": "Verify", "hosts": "localhost", "gather_facts": False, "roles": [{"role": "v100box.llm.llama_verify"}],
             "post_tasks": [{"name": "Show what the role decided", "ansible.builtin.debug": {
                 "msg": "windows={{ _llama_verify_windows }} nccl={{ _llama_verify_nccl_instances "
                        "| map(attribute='name') | join(',') }}"}}]}]


def _stats(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{"):])["global_custom_stats"]


def _shown(stdout: str) -> str:
    return json.loads(stdout[stdout.index("{"):])["plays"][0]["tasks"][-1]["hosts"]["localhost"]["msg"]


@pytest.mark.parametrize("windows", [True, False])
def test_results_are_published_under_llama_verify_on_both_oses(tmp_path, windows):
    result = run_playbook(tmp_path, play(), {"llama_verify_instances": []}, json_output=True, windows=windows)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _stats(result.stdout) == {"llama_verify": {"localhost": {}}}
    assert _shown(result.stdout) == f"windows={windows} nccl="


def test_without_facts_a_powershell_host_is_windows(tmp_path):
    result = run_playbook(tmp_path, play(), {"llama_verify_instances": [], "ansible_shell_type": "powershell"},
                          json_output=True, windows=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _shown(result.stdout) == "windows=True nccl="


def test_nccl_instances_come_from_the_instance_or_its_environment(tmp_path):
    instances = [
        {"name": "a", "model": "m", "port": 1, "nccl": True},
        {"name": "b", "model": "m", "port": 2, "env": {"GGML_CUDA_ALLREDUCE": "nccl"}},
        {"name": "c", "model": "m", "port": 3, "nccl": False, "env": {"GGML_CUDA_ALLREDUCE": "nccl"}},
        {"name": "d", "model": "m", "port": 4, "env": None},
    ]
    plays = play()
    plays[0]["roles"] = []
    plays[0]["vars_files"] = role_vars("llama_verify")
    plays[0]["post_tasks"][0]["ansible.builtin.debug"]["msg"] = (
        "{{ _llama_verify_nccl_instances | map(attribute='name') | join(',') }}")
    result = run_playbook(tmp_path, plays, {"llama_verify_instances": instances}, json_output=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _shown(result.stdout) == "a,b"
