"""The WinSW XML and the Claude Code helpers of roles/llama_service (Windows), rendered by Ansible and checked
against the plan."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.unit.windows.ansible_local import ROLES, WINDOWS_FACTS, role_vars, run_playbook
from tests.unit.windows.cmdline import split
from tests.unit.windows.powershell import parse_errors

# Each module runs ansible-playbook on localhost: seconds per run.
pytestmark = pytest.mark.slow

GEMMA = {
    "name": "llama-gemma4",
    "model": "gemma4-26b-a4b-qat-q4_0",
    "engine": "upstream",
    "version": "02182fc",
    "port": 8011,
    "env": {"CUDA_VISIBLE_DEVICES": "0"},
    "args": [
        "--model", r"C:\llama\models\gemma-4-26B_q4_0-it.gguf", "--alias", "gemma4-26b-a4b-qat-q4_0",
        "--host", "127.0.0.1", "--port", "8011", "-ngl", "99", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0",
        "-c", "32768", "-t", "6", "--jinja", "--chat-template-file", r"C:\llama\templates\gemma4-nothink.jinja",
    ],
}  # fmt: skip

# Arguments that break naive quoting: spaces, embedded quotes, XML metacharacters, a trailing backslash, an empty value.
QWEN_DUAL = {
    "name": "llama-qwen-dual",
    "model": "Qwen3.6-35B-A3B",
    "engine": "dual-nccl",
    "version": "b1-nccl",
    "port": 8001,
    "env": {"CUDA_VISIBLE_DEVICES": "0,1", "GGML_CUDA_ALLREDUCE": "nccl"},
    "args": [
        "--model", r"C:\My Models\Qwen3.6 35B\Qwen3.6-35B-A3B-IQ4_XS-4.19bpw.gguf", "--alias", "Qwen3.6-35B-A3B",
        "-sm", "tensor", "--spec-type", "mtp:n_max=3,p_min=0.75", "--system-prompt", 'say "hi" & <bye>',
        "--slot-save-path", "C:\\llama\\slots dir\\", "--api-prefix", "", "--parallel", "4",
    ],
}  # fmt: skip

KEY = "k3y&<with>\"quotes'-0123456789"


def render(tmp_path: Path, bind: str, api_key: str, instances: list[dict], virtual_account: bool = True,
           more_vars: dict | None = None) -> Path:
    """Render the WinSW XML and the Claude Code helper of each instance into tmp_path/out, as the role would."""
    out = tmp_path / "out"
    out.mkdir()
    templates = ROLES / "llama_service" / "templates"
    plays = [
        {
            "name": "Render the Windows service artefacts",
            "hosts": "localhost",
            "gather_facts": False,
            "vars_files": role_vars("llama_service"),
            "tasks": [
                {
                    "name": "Render the WinSW XML",
                    "ansible.builtin.template": {
                        "src": str(templates / "winsw.xml.j2"),
                        "dest": f"{out}/{{{{ item.name }}}}.xml",
                        "mode": "0600",
                    },
                    "loop": "{{ llama_service_instances }}",
                },
                {
                    "name": "Render the Claude Code helpers",
                    "ansible.builtin.template": {
                        "src": str(templates / "claude.ps1.j2"),
                        "dest": f"{out}/{{{{ item.name }}}}.ps1",
                        "mode": "0644",
                    },
                    "loop": "{{ llama_service_instances }}",
                },
            ],
        }
    ]
    extra = {
        **WINDOWS_FACTS,
        "llama_service_instances": instances,
        "llama_service_bind": bind,
        "llama_service_api_key": api_key,
        "llama_service_virtual_account": virtual_account,
        **(more_vars or {}),
    }
    result = run_playbook(tmp_path, plays, extra)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


@pytest.fixture(scope="module")
def loopback(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("loopback"), "127.0.0.1", "", [GEMMA, QWEN_DUAL])


@pytest.fixture(scope="module")
def exposed(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("exposed"), "0.0.0.0", KEY, [GEMMA, QWEN_DUAL])


def service(out: Path, instance: dict) -> ET.Element:
    root = ET.parse(out / f"{instance['name']}.xml").getroot()
    assert root.tag == "service"
    return root


@pytest.mark.parametrize("instance", [GEMMA, QWEN_DUAL], ids=lambda i: i["name"])
def test_xml_runs_the_planned_server_with_the_planned_arguments(loopback, instance):
    root = service(loopback, instance)
    assert root.findtext("id") == instance["name"]
    assert instance["model"] in root.findtext("description")
    assert root.findtext("executable") == (
        rf"C:\llama\engines\{instance['engine']}\{instance['version']}\bin\llama-server.exe"
    )
    # What llama-server.exe's C runtime will see as argv[1:].
    assert split(root.findtext("arguments")) == instance["args"]
    assert root.findtext("workingdirectory") == rf"C:\llama\services\{instance['name']}"
    assert root.findtext("startmode") == "Automatic"


@pytest.mark.parametrize("instance", [GEMMA, QWEN_DUAL], ids=lambda i: i["name"])
def test_xml_restarts_rolls_logs_and_ends_children(loopback, instance):
    root = service(loopback, instance)
    failures = root.findall("onfailure")
    assert [(f.get("action"), f.get("delay")) for f in failures] == [("restart", "10 sec")]
    assert root.findtext("resetfailure") == "3600 sec"
    assert root.findtext("stoptimeout") == "30 sec"
    assert root.findtext("stopparentprocessfirst") == "true"
    assert root.findtext("logpath") == rf"C:\llama\services\{instance['name']}\logs"
    log = root.find("log")
    assert log.get("mode") == "roll-by-size"
    assert log.findtext("sizeThreshold") == "10240"
    assert log.findtext("keepFiles") == "8"


def test_xml_environment_without_a_key(loopback):
    env = {e.get("name"): e.get("value") for e in service(loopback, QWEN_DUAL).findall("env")}
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1", "GGML_CUDA_ALLREDUCE": "nccl"}


def test_xml_passes_the_key_as_a_file_and_nowhere_else(exposed):
    for instance in (GEMMA, QWEN_DUAL):
        root = service(exposed, instance)
        # ik_llama.cpp ignores LLAMA_API_KEY: the key must reach every engine as --api-key-file.
        env = {e.get("name"): e.get("value") for e in root.findall("env")}
        assert env == instance["env"]
        assert split(root.findtext("arguments")) == [*instance["args"], "--api-key-file", r"C:\llama\secrets\api-key.txt"]
        # Neither the command line (any user can list it) nor the XML holds the key itself.
        text = (exposed / f"{instance['name']}.xml").read_text()
        assert KEY not in text and "0123456789" not in text


def test_xml_without_a_key_passes_no_key_file(loopback):
    for instance in (GEMMA, QWEN_DUAL):
        assert "--api-key-file" not in split(service(loopback, instance).findtext("arguments"))


@pytest.mark.parametrize("instance", [GEMMA, QWEN_DUAL], ids=lambda i: i["name"])
def test_xml_runs_the_server_as_its_virtual_account(exposed, instance):
    # WinSW v2 reads <domain> and <user>; v3's <username> would be ignored and leave the service on LocalSystem.
    (account,) = service(exposed, instance).findall("serviceaccount")
    assert (account.findtext("domain"), account.findtext("user")) == ("NT SERVICE", instance["name"])
    assert account.find("username") is None and account.find("password") is None


def test_xml_keeps_localsystem_when_virtual_accounts_are_off(tmp_path):
    out = render(tmp_path, "127.0.0.1", "", [GEMMA], virtual_account=False)
    assert service(out, GEMMA).find("serviceaccount") is None


def ps_value(script: str, variable: str) -> str:
    match = re.search(rf"^\$env:{variable} = (.+)$", script, re.M) or re.search(rf"^\${variable} = (.+)$", script, re.M)
    assert match, f"{variable} is not set"
    return match.group(1)


def test_helper_without_key_points_claude_code_at_the_server(loopback):
    script = (loopback / "llama-qwen-dual.ps1").read_text()
    assert parse_errors(script) == []
    assert ps_value(script, "ANTHROPIC_BASE_URL") == "'http://127.0.0.1:8001'"
    assert ps_value(script, "model") == "'Qwen3.6-35B-A3B'"
    for slot in ("MODEL", "SMALL_FAST_MODEL", "DEFAULT_OPUS_MODEL", "DEFAULT_SONNET_MODEL", "DEFAULT_HAIKU_MODEL"):
        assert ps_value(script, f"ANTHROPIC_{slot}") == "$model"
    assert ps_value(script, "ANTHROPIC_AUTH_TOKEN") == "$token"
    assert ps_value(script, "token") == "'no-key'"
    assert "& claude @args" in script


def test_helper_with_key_reads_it_from_the_protected_file(exposed):
    script = (exposed / "llama-gemma4.ps1").read_text()
    assert parse_errors(script) == []
    assert KEY not in script and "0123456789" not in script
    assert ps_value(script, "keyFile") == r"'C:\llama\secrets\api-key.txt'"
    assert "Get-Content -LiteralPath $keyFile -Raw" in script
    # A wildcard bind is reached on loopback from the box itself.
    assert ps_value(script, "ANTHROPIC_BASE_URL") == "'http://127.0.0.1:8011'"


def test_helper_brackets_an_ipv6_bind(tmp_path):
    out = render(tmp_path, "::1", "", [GEMMA])
    script = (out / "llama-gemma4.ps1").read_text()
    assert parse_errors(script) == []
    assert ps_value(script, "ANTHROPIC_BASE_URL") == "'http://[::1]:8011'"


def test_helper_carries_the_clients_environment_from_the_plan(tmp_path):
    """The same variables `controller clients` prints: the planned context for compaction, the output budget."""
    env = {"ANTHROPIC_MODEL": GEMMA["model"], "CLAUDE_CODE_AUTO_COMPACT_WINDOW": "32768",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "8192", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    out = render(tmp_path, "127.0.0.1", "", [GEMMA],
                 more_vars={"agent_clients_services": [{"name": GEMMA["name"], "model": GEMMA["model"], "env": env}]})
    script = (out / "llama-gemma4.ps1").read_text()
    assert parse_errors(script) == []
    assert ps_value(script, "CLAUDE_CODE_AUTO_COMPACT_WINDOW") == "'32768'"
    assert ps_value(script, "CLAUDE_CODE_MAX_OUTPUT_TOKENS") == "'8192'"
    assert ps_value(script, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC") == "'1'"
    assert ps_value(script, "ANTHROPIC_MODEL") == "$model"
