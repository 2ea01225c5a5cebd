"""The WinRM transport against a real WS-Management endpoint on 127.0.0.1 (HTTP and HTTPS).

The endpoint (tests/unit/transports/wsman_server.py) speaks the SOAP messages pywinrm sends, with basic
or NTLM authentication, and answers the probe script with the Windows fixture's captured outputs, so
these tests cover the transport's HTTP, TLS, authentication and XML layers, the one-round-trip probe
script, and every failure an operator can meet: an untrusted certificate, wrong credentials, nothing
listening, a silent port, the wrong scheme, a command that hangs. No real Windows host is involved.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import yaml
from winrm import transport as pywinrm_transport

from controller.errors import FleetError, TransportError
from controller.model.fleet import Box, load_fleet
from controller.stages.probe import WINDOWS_PROBE_COMMANDS, parse_outputs, read_dir
from controller.stages.probe.collect import probe_box
from controller.stages.probe.windows_collect import windows_probe_script, windows_probe_sections
from controller.stages.transports.winrm import (
    COMMAND_LINE_LIMIT,
    WinRmTransport,
    powershell_command_line,
    readable_stderr,
)
from tests.cli import run_controller
from tests.unit.transports.wsman_server import StandInWindows, TlsFiles, WsmanServer, self_signed_certificate

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "probe"
WINDOWS_BOX = FIXTURES / "dual-v100-nvlink-windows-tcc"
USER = "probe"
PASSWORD = "correct horse battery staple"
TRANSPORT_EXIT = 3


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def https_server(tls: TlsFiles) -> Iterator[WsmanServer]:
    with WsmanServer(StandInWindows(WINDOWS_BOX), user=USER, password=PASSWORD, tls=tls) as server:
        yield server


@pytest.fixture
def http_server() -> Iterator[WsmanServer]:
    with WsmanServer(StandInWindows(WINDOWS_BOX), user=USER, password=PASSWORD) as server:
        yield server


def write_fleet(folder: Path, port: int, *, scheme: str = "https", skip_verify: bool = False,
                password: str | None = PASSWORD, auth: str = "basic") -> Path:
    box: dict[str, object] = {
        "address": "127.0.0.1", "port": port, "transport": "winrm", "os": "windows", "user": USER,
        "winrm_scheme": scheme, "winrm_transport": auth, "winrm_insecure_skip_verify": skip_verify,
    }
    if password is not None:
        secret = folder / "winrm-password"
        secret.write_text(password + "\n")
        box["password"] = {"file": str(secret)}
    path = folder / "fleet.yml"
    path.write_text(yaml.safe_dump({"boxes": {"win1": box}}))
    return path


def box_of(fleet: Path) -> Box:
    return load_fleet(fleet).box("win1")


def expected_profile(fixtures: Path = WINDOWS_BOX):
    """What `controller probe --from-dir` makes of the same captured outputs."""
    return parse_outputs(read_dir(fixtures), model_dir="C:\\llama\\models")


controller = partial(run_controller, timeout=120)


def assert_one_line_failure(done: subprocess.CompletedProcess[str], code: int, *fragments: str) -> str:
    assert done.returncode == code, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stdout == ""
    message = done.stderr.strip()
    assert len(message.splitlines()) == 1, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------------- success


def test_probe_over_https_with_skip_verify_matches_the_captured_profile(https_server: WsmanServer,
                                                                        tmp_path: Path) -> None:
    box = box_of(write_fleet(tmp_path, https_server.port, skip_verify=True))
    profile, outputs, seconds = probe_box(box)
    assert profile == expected_profile()
    assert [gpu.name for gpu in profile.gpus] == ["Tesla V100-SXM2-16GB"] * 2
    assert profile.driver.version == "573.96" and profile.driver.model == "TCC"
    assert profile.boards == [[0, 1]] and profile.os.family == "windows"
    assert profile.cpu.avx2 is True and profile.memory_mib == 65440
    assert set(outputs) == set(WINDOWS_PROBE_COMMANDS)
    # One PowerShell round trip; the shell is deleted afterwards.
    assert https_server.actions == ["Create", "Command", "Receive", "Receive", "Receive", "Signal", "Delete"]
    assert len(https_server.windows.scripts) == 1 and https_server.shells == set()
    assert seconds < 3


def test_probe_over_plain_http(http_server: WsmanServer, tmp_path: Path) -> None:
    box = box_of(write_fleet(tmp_path, http_server.port, scheme="http"))
    assert box.effective_port == http_server.port
    profile, _outputs, _seconds = probe_box(box)
    assert profile == expected_profile()
    assert http_server.actions.count("Command") == 1


def test_cli_probe_over_winrm_prints_the_from_dir_json(https_server: WsmanServer, tmp_path: Path) -> None:
    fleet = write_fleet(tmp_path, https_server.port, skip_verify=True)
    done = controller("probe", "win1", "--fleet", str(fleet), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == expected_profile().model_dump(mode="json")


def test_run_returns_stdout_exit_code_and_readable_stderr(https_server: WsmanServer, tmp_path: Path) -> None:
    box = box_of(write_fleet(tmp_path, https_server.port, skip_verify=True))
    with WinRmTransport(box) as transport:
        result = transport.run(windows_probe_script())
        again = transport.run("Get-Date")  # not a probe script: the stand-in prints nothing
    assert result.rc == 0 and result.stdout.startswith("\n==> v100-llm-box probe output: nvidia-smi-query.csv\n")
    assert result.stderr == ""  # PowerShell's CLIXML progress records are noise, not errors
    assert again.rc == 0 and again.stdout == ""
    assert https_server.actions.count("Create") == 1  # both commands ran in the one shell
    assert https_server.actions[-1] == "Delete"


def test_box_without_a_driver_probes_as_cpu_only_windows(tmp_path: Path) -> None:
    folder = tmp_path / "no-driver"
    folder.mkdir()
    shutil.copy(WINDOWS_BOX / "windows-cim.json", folder)  # nvidia-smi.exe is missing: sections stay empty
    with WsmanServer(StandInWindows(folder), user=USER, password=PASSWORD) as server:
        profile, outputs, _ = probe_box(box_of(write_fleet(tmp_path, server.port, scheme="http")))
    assert outputs["nvidia-smi.txt"] == "" and outputs["nvidia-smi-query.csv"] == ""
    assert profile.gpus == [] and profile.driver.version is None
    assert profile.os.name == "Microsoft Windows 11 Pro" and profile.warnings == []


@pytest.fixture
def ntlm_accounts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local account (no domain) for the NTLM acceptor, in the Heimdal format pyspnego reads."""
    accounts = tmp_path / "ntlm-accounts"
    accounts.write_text(f":{USER}:{PASSWORD}\n")
    monkeypatch.setenv("NTLM_USER_FILE", str(accounts))


def test_ntlm_over_https_the_fleet_default(tls: TlsFiles, tmp_path: Path, ntlm_accounts: None) -> None:
    with WsmanServer(StandInWindows(WINDOWS_BOX), user=USER, password=PASSWORD, tls=tls, auth="ntlm") as server:
        box = box_of(write_fleet(tmp_path, server.port, skip_verify=True, auth="ntlm"))
        assert Box(name="x", address="y").winrm_transport == "ntlm"  # what a fleet file gets by default
        profile, _outputs, _seconds = probe_box(box)
    assert profile == expected_profile()
    assert server.ntlm_logins == [USER]  # one NTLM login, bound to the TLS channel, for the whole probe
    assert server.actions[-1] == "Delete"


def test_ntlm_with_a_wrong_password_is_rejected(tls: TlsFiles, tmp_path: Path, ntlm_accounts: None) -> None:
    with WsmanServer(StandInWindows(WINDOWS_BOX), user=USER, password=PASSWORD, tls=tls, auth="ntlm") as server:
        box = box_of(write_fleet(tmp_path, server.port, skip_verify=True, auth="ntlm", password="wrong"))
        with pytest.raises(TransportError, match=r"rejected the credentials \(HTTP 401, ntlm authentication\)"):
            probe_box(box)
    assert server.ntlm_logins == [] and server.actions == []


def test_validation_accepts_a_certificate_this_machine_trusts(https_server: WsmanServer, tls: TlsFiles,
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tls.cert))  # as an operator with their own CA would
    box = box_of(write_fleet(tmp_path, https_server.port))
    assert box.winrm_insecure_skip_verify is False
    profile, _outputs, _seconds = probe_box(box)
    assert profile == expected_profile()


# ------------------------------------------------------------------------------------- failures


def test_default_validation_refuses_a_self_signed_certificate(https_server: WsmanServer, tmp_path: Path) -> None:
    fleet = write_fleet(tmp_path, https_server.port)
    done = controller("probe", "win1", "--fleet", str(fleet), "--json")
    assert_one_line_failure(done, TRANSPORT_EXIT, "the HTTPS certificate does not validate (self-signed certificate)",
                            "fix the certificate", "set `winrm_insecure_skip_verify: true` for this box")
    assert https_server.actions == [] and https_server.handshake_failures >= 1  # no credentials were sent


def test_wrong_credentials_are_one_clear_line(https_server: WsmanServer, tmp_path: Path) -> None:
    fleet = write_fleet(tmp_path, https_server.port, skip_verify=True, password="not the password")
    done = controller("probe", "win1", "--fleet", str(fleet))
    assert_one_line_failure(done, TRANSPORT_EXIT, f"box win1 (127.0.0.1:{https_server.port}) as {USER}",
                            "rejected the credentials (HTTP 401, basic authentication)",
                            "check 'user', 'password' and 'winrm_transport'")
    assert https_server.auth_failures >= 1 and https_server.actions == []


def test_nothing_listening_is_one_clear_line(tmp_path: Path) -> None:
    port = closed_port()
    done = controller("probe", "win1", "--fleet", str(write_fleet(tmp_path, port)))
    assert_one_line_failure(done, TRANSPORT_EXIT, f"box win1 (127.0.0.1:{port}): connection refused",
                            "check 'port' and 'winrm_scheme'")


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_port_that_never_answers_times_out(tmp_path: Path, scheme: str) -> None:
    with socket.socket() as silent:  # listens (the kernel completes the handshake) but never reads
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        box = box_of(write_fleet(tmp_path, silent.getsockname()[1], scheme=scheme))
        started = time.monotonic()
        with pytest.raises(TransportError, match=r"no HTTP answer within 2 s; check that this port") as failure:
            WinRmTransport(box, timeout=1).run("Get-Date")
    assert time.monotonic() - started < 10
    assert str(failure.value).startswith(f"box win1 (127.0.0.1:{box.effective_port})")


def test_https_box_pointed_at_an_http_listener_names_the_scheme(http_server: WsmanServer, tmp_path: Path) -> None:
    box = box_of(write_fleet(tmp_path, http_server.port, scheme="https"))
    with pytest.raises(TransportError, match="TLS handshake failed .*check 'winrm_scheme'"):
        WinRmTransport(box).run("Get-Date")


def test_http_box_pointed_at_an_https_listener_names_the_scheme(https_server: WsmanServer, tmp_path: Path) -> None:
    box = box_of(write_fleet(tmp_path, https_server.port, scheme="http"))
    with pytest.raises(TransportError, match="connection to the WinRM service failed .*check 'winrm_scheme'"):
        WinRmTransport(box).run("Get-Date")
    assert https_server.actions == []


def test_a_command_that_never_finishes_is_terminated(tls: TlsFiles, tmp_path: Path) -> None:
    with WsmanServer(StandInWindows(WINDOWS_BOX), user=USER, password=PASSWORD, tls=tls, hang=True) as server:
        box = box_of(write_fleet(tmp_path, server.port, skip_verify=True))
        with WinRmTransport(box) as transport, pytest.raises(TransportError, match="did not finish within 1 s"):
            transport.run("Start-Sleep 3600", timeout=1)
        (command,) = server.commands.values()
    assert command.terminated  # signalled on the box, not left running
    assert server.actions[-2:] == ["Signal", "Delete"]


def test_a_box_without_a_password_is_a_fleet_error(http_server: WsmanServer, tmp_path: Path) -> None:
    fleet = write_fleet(tmp_path, http_server.port, scheme="http", password=None, auth="ntlm")
    with pytest.raises(FleetError, match="WinRM with ntlm authentication needs a password"):
        WinRmTransport(box_of(fleet)).run("Get-Date")
    done = controller("probe", "win1", "--fleet", str(fleet))
    assert_one_line_failure(done, 2, "needs a password")


def test_kerberos_without_its_extra_says_what_to_install(http_server: WsmanServer, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pywinrm_transport, "HAVE_KERBEROS", False)
    box = box_of(write_fleet(tmp_path, http_server.port, scheme="http", password=None, auth="kerberos"))
    with pytest.raises(TransportError, match=r"kerberos authentication needs pywinrm\[kerberos\]: pip install"):
        WinRmTransport(box).run("Get-Date")


# ------------------------------------------------------------------------------- the script itself


def test_probe_script_covers_every_windows_output_and_fits_cmd_exe() -> None:
    assert set(windows_probe_sections()) == set(WINDOWS_PROBE_COMMANDS)
    line = powershell_command_line(windows_probe_script())
    assert len(line) <= COMMAND_LINE_LIMIT, f"{len(line)} characters: the probe script outgrew cmd.exe"


def test_an_oversized_script_is_refused_before_connecting(tmp_path: Path) -> None:
    box = box_of(write_fleet(tmp_path, closed_port()))
    with pytest.raises(TransportError, match="over cmd.exe's 8191; split it"):
        WinRmTransport(box).run("Write-Output 'x'\n" * 400)


def test_clixml_stderr_keeps_the_error_lines() -> None:
    raw = (b'#< CLIXML\r\n<Objs Version="1.1.0.1" xmlns="http://schemas.microsoft.com/powershell/2004/04">'
           b'<Obj S="progress" RefId="0"><MS><I64 N="SourceId">1</I64></MS></Obj>'
           b'<S S="Error">nvidia-smi.exe : The term &apos;nvidia-smi.exe&apos; is not recognized_x000D__x000A_</S>'
           b'<S S="Error">At line:1 char:1_x000D__x000A_</S></Objs>')
    assert readable_stderr(raw) == "nvidia-smi.exe : The term 'nvidia-smi.exe' is not recognized\nAt line:1 char:1"
    assert readable_stderr(b"plain text\r\n") == "plain text\r\n"
