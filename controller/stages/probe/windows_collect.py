"""Collect a Windows box's probe outputs in one PowerShell round trip (WinRM).

A WinRM command costs several HTTP exchanges (create a shell, start the command, poll its output,
signal, delete the shell), so the probe sends every ``nvidia-smi.exe`` call and the CIM query as one
script. Each output is written after a marker line, exactly like the Linux script
(:data:`~controller.stages.probe.commands.OUTPUT_MARKER`), so
:func:`~controller.stages.probe.commands.split_probe_output` gives back the same ``--from-dir`` names and
:func:`~controller.stages.probe.parse.parse_outputs` the same profile as for captured files.

Why the script looks the way it does:

* Outputs are written with ``[Console]::Out.Write``, never to the pipeline: PowerShell's formatter
  (``Out-Default``) may wrap or reflow what it prints, and the parsers need the tool's own lines.
* ``[Console]::OutputEncoding`` is set to UTF-8, so the native tool's output is decoded and
  re-encoded as UTF-8 rather than through the OEM code page.
* Newer drivers put ``nvidia-smi.exe`` in System32 (on PATH); older ones in
  ``%ProgramFiles%\\NVIDIA Corporation\\NVSMI``, which is added to PATH for this script only.
* A missing tool (no driver yet) is a normal state: every section swallows its errors and the
  script exits 0, so one missing tool never costs the other outputs.
* Drivers before R510 reject the ``compute_cap`` field; the query is then repeated without it,
  as on Linux.

This script has not run on a real Windows host in this project's tests (none exists here); the
tests run it through a WS-Management endpoint that answers the way Windows does.
"""

from __future__ import annotations

from controller.errors import ProbeError
from controller.stages.probe.commands import OUTPUT_MARKER, WINDOWS_PROBE_COMMANDS, split_probe_output
from controller.stages.probe.nvidia_smi import QUERY_FIELDS
from controller.stages.transports.base import Transport

SECTION_FUNCTION = "Write-V100ProbeSection"
"""The PowerShell function that writes one marked output; each section is one call of it."""

PROBE_TIMEOUT_S = 120.0
"""nvidia-smi on a wedged GPU can take a minute per call; beyond this the box needs a person."""

_QUERY = ",".join(QUERY_FIELDS)
_QUERY_WITHOUT_CAP = ",".join(name for name in QUERY_FIELDS if name != "compute_cap")

_PRELUDE = f"""\
$ProgressPreference = 'SilentlyContinue'
try {{ [Console]::OutputEncoding = New-Object System.Text.UTF8Encoding $false }} catch {{ }}
$nvsmi = Join-Path $env:ProgramFiles 'NVIDIA Corporation\\NVSMI'
if (Test-Path -LiteralPath $nvsmi) {{ $env:Path = $env:Path + ';' + $nvsmi }}
$marker = '{OUTPUT_MARKER}'
function {SECTION_FUNCTION}([string]$Name, [scriptblock]$Body) {{
  [Console]::Out.Write("`n" + $marker + $Name + "`n")
  $lines = @(try {{ & $Body }} catch {{ }})
  if ($lines.Count -gt 0) {{ [Console]::Out.Write((($lines | ForEach-Object {{ [string]$_ }}) -join "`n") + "`n") }}
}}"""

# Like the Linux command: keep the first answer only when nvidia-smi accepted every field.
_QUERY_WITH_FALLBACK = (
    f"$out = @(& nvidia-smi.exe --query-gpu={_QUERY} --format=csv 2>$null)\n"
    f"if ($LASTEXITCODE -ne 0) {{ $out = @(& nvidia-smi.exe --query-gpu={_QUERY_WITHOUT_CAP} --format=csv 2>$null) }}\n"
    "$out"
)


def windows_probe_sections() -> dict[str, str]:
    """Output file name -> PowerShell body of its section (WINDOWS_PROBE_COMMANDS, query with fallback)."""
    sections = dict(WINDOWS_PROBE_COMMANDS)
    sections["nvidia-smi-query.csv"] = _QUERY_WITH_FALLBACK
    return sections


def windows_probe_script() -> str:
    """Every Windows probe command as one PowerShell script; its stdout splits back into outputs."""
    parts = [_PRELUDE]
    for name, body in windows_probe_sections().items():
        parts.append(f"{SECTION_FUNCTION} '{name}' {{\n{body}\n}}")
    parts.append("exit 0")
    return "\n".join(parts) + "\n"


def collect(transport: Transport) -> dict[str, str]:
    """Run the probe script over ``transport`` (PowerShell) and return the outputs by file name."""
    result = transport.run(windows_probe_script(), timeout=PROBE_TIMEOUT_S)
    outputs = split_probe_output(result.stdout)
    if not outputs:
        raise ProbeError(
            f"{transport.where}: the PowerShell probe printed nothing usable (exit {result.rc}): "
            f"{result.stderr.strip()[:200] or 'no error output'}; can this user run powershell.exe?"
        )
    return outputs
