"""Every PowerShell body in the roles' Windows tasks, and every PowerShell module, parses; the parser does catch
broken scripts."""

from pathlib import Path

import pytest

from tests.unit.windows.ansible_local import PROJECT
from tests.unit.windows.powershell import parse_errors, role_scripts

SCRIPTS = list(role_scripts())
MODULES = sorted((PROJECT / "ansible_collections/v100box/llm/plugins").glob("*/*.ps1"))


def test_the_roles_scripts_were_found():
    # driver query, engine move, model volume/marker/move, service log tail, verify NCCL load
    assert len(SCRIPTS) >= 7, [where for where, _ in SCRIPTS]


@pytest.mark.parametrize(("where", "script"), SCRIPTS, ids=[where for where, _ in SCRIPTS])
def test_script_parses_and_takes_values_only_as_parameters(where, script):
    assert parse_errors(script) == [], where
    # Values reach a script through `parameters`, never by templating its text, so the parsed text is what runs.
    assert "{{" not in script and "{%" not in script, where


@pytest.mark.parametrize("module", MODULES, ids=[path.name for path in MODULES])
def test_powershell_module_parses(module: Path):
    assert parse_errors(module.read_text()) == []
    assert "#AnsibleRequires -CSharpUtil Ansible.Basic" in module.read_text()


def test_each_windows_module_is_run_by_its_linux_twins_action():
    # win_<name>.ps1 has a name of its own, so that no lookup of <name> (the mitogen strategy's takes a module of
    # any extension) finds it on a Linux box; the action plugin <name> runs it on a PowerShell host, so a role checks
    # a box with one task (tests/unit/plugins/test_module_resolution.py).
    plugins = PROJECT / "ansible_collections/v100box/llm/plugins"
    assert [str(path.relative_to(plugins)) for path in MODULES] == ["modules/win_llama_api_check.ps1"]
    for path in MODULES:
        twin = path.name.removeprefix("win_").removesuffix(".ps1")
        assert (plugins / "modules" / f"{twin}.py").is_file() and not (plugins / "modules" / f"{twin}.ps1").exists()
        assert f'"v100box.llm.{path.stem}"' in (plugins / "action" / f"{twin}.py").read_text()


@pytest.mark.parametrize(
    "broken",
    [
        "if ($a { Write-Output 1 }",
        "$x = @{ a = 1",
        "function f { param([string]$p) ",
        "$s = @'\nunterminated here-string\n",
    ],
)
def test_parser_reports_broken_scripts(broken):
    assert parse_errors(broken) != []
