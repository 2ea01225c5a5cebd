"""The Windows model-folder refusals of roles/gguf_model's preflight, run by Ansible on localhost."""

import json

import pytest

from tests.unit.windows.ansible_local import WINDOWS_FACTS, run_playbook

# Each module runs ansible-playbook on localhost: seconds per run.
pytestmark = pytest.mark.slow

CASES = {
    r"C:\llama\models": None,
    r"D:\Models With Spaces": None,
    "e:/llama/models": None,
    r"\\wsl$\Ubuntu\home\me\models": "inside a WSL distribution",
    r"\\wsl.localhost\Ubuntu-24.04\models": "inside a WSL distribution",
    r"\\WSL$\Debian\srv": "inside a WSL distribution",
    r"\\nas\share\models": "UNC path to a network share",
    "//nas/share/models": "UNC path to a network share",
    r"\\?\UNC\nas\share": "UNC path to a network share",
    r"llama\models": "not an absolute path on a drive letter",
    "/var/lib/llama/models": "not an absolute path on a drive letter",
    r"C:models": "not an absolute path on a drive letter",
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("modeldir")
    (tmp / "case.yml").write_text(
        """
- name: Try one model folder
  block:
    - name: Run the preflight
      ansible.builtin.include_role:
        name: v100box.llm.gguf_model
        tasks_from: windows-preflight
      vars:
        gguf_model_dir: "{{ case }}"
    - name: Record a pass
      ansible.builtin.set_fact:
        outcomes: "{{ outcomes | combine({case: none}) }}"
  rescue:
    - name: Record the refusal
      ansible.builtin.set_fact:
        outcomes: "{{ outcomes | combine({case: ansible_failed_result.msg}) }}"
"""
    )
    result_file = tmp / "outcomes.json"
    plays = [
        {
            "name": "Check model folders",
            "hosts": "localhost",
            "gather_facts": False,
            "vars": {"outcomes": {}},
            "tasks": [
                {
                    "name": "Try each folder",
                    "ansible.builtin.include_tasks": str(tmp / "case.yml"),
                    "loop": list(CASES),
                    "loop_control": {"loop_var": "case"},
                },
                {
                    "name": "Write the outcomes",
                    "ansible.builtin.copy": {
                        "content": "{{ outcomes | to_json }}",
                        "dest": str(result_file),
                        "mode": "0644",
                    },
                },
            ],
        }
    ]
    result = run_playbook(tmp, plays, {"gguf_model_files": []})
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result_file.read_text())


@pytest.mark.parametrize(("folder", "reason"), CASES.items(), ids=list(CASES))
def test_model_folder(outcomes, folder, reason):
    message = outcomes[folder]
    if reason is None:
        assert message is None
    else:
        assert message is not None, f"{folder} was accepted"
        assert reason in message
        assert folder in message
        assert "local NTFS volume" in message


def test_bad_model_entries_are_refused(tmp_path):
    plays = [
        {
            "name": "Preflight",
            "hosts": "localhost",
            "gather_facts": False,
            "tasks": [
                {
                    "name": "Run the preflight",
                    "ansible.builtin.include_role": {"name": "v100box.llm.gguf_model", "tasks_from": "preflight"},
                }
            ],
        }
    ]
    bad = {"gguf_model_dir": WINDOWS_FACTS["gguf_model_dir"],
           "gguf_model_files": [{"name": r"sub\model.gguf", "url": "https://x.example/m", "sha256": "a" * 64}]}
    result = run_playbook(tmp_path, plays, bad)
    assert result.returncode != 0
    assert "plain Windows file name" in result.stdout
