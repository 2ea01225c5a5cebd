"""Every PowerShell body in the Windows roles parses, and the parser does catch broken scripts."""

import pytest

from tests.unit.windows.powershell import parse_errors, role_scripts

SCRIPTS = list(role_scripts())


def test_the_roles_scripts_were_found():
    # driver query, engine move, model volume/marker/move, service log tail, verify NCCL load
    assert len(SCRIPTS) >= 7, [where for where, _ in SCRIPTS]


@pytest.mark.parametrize(("where", "script"), SCRIPTS, ids=[where for where, _ in SCRIPTS])
def test_script_parses_and_takes_values_only_as_parameters(where, script):
    assert parse_errors(script) == [], where
    # Values reach a script through `parameters`, never by templating its text, so the parsed text is what runs.
    assert "{{" not in script and "{%" not in script, where


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
