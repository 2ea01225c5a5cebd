"""Run PowerShell over WinRM with pywinrm (WS-Management SOAP over HTTPS or HTTP).

One transport keeps one remote shell: a probe is a single PowerShell script, so it costs one
Create, one Command, a few Receives, one Signal and one Delete.

Security defaults: HTTPS with the certificate validated against the CAs this machine trusts
(``REQUESTS_CA_BUNDLE`` / ``CURL_CA_BUNDLE`` when set, else the bundle requests ships); "ignore"
only when the fleet file sets ``winrm_insecure_skip_verify: true`` for the box. No HTTP proxy is
used, as for SSH. Credentials are never sent before the TLS handshake has succeeded, so a box
whose certificate does not validate never sees the password.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import socket
import ssl
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from html import unescape

import requests
from winrm.exceptions import (
    InvalidCredentialsError,
    WinRMError,
    WinRMOperationTimeoutError,
    WinRMTransportError,
    WSManFaultError,
)
from winrm.protocol import Protocol

from controller.errors import FleetError, TransportError
from controller.model.fleet import Box
from controller.stages.transports.base import CommandResult, Transport

COMMAND_LINE_LIMIT = 8191
"""cmd.exe's limit on a command line; WinRM starts commands through cmd.exe, as pywinrm's run_ps does."""

UTF8_CODEPAGE = 65001
_POWERSHELL = "powershell.exe -NoProfile -NonInteractive -EncodedCommand "
_EXTRAS = {"kerberos": "pywinrm[kerberos]", "credssp": "pywinrm[credssp]"}


def powershell_command_line(script: str) -> str:
    """The cmd.exe line that runs ``script``: Base64 of UTF-16LE, so no quoting can break it."""
    return _POWERSHELL + base64.b64encode(script.encode("utf-16-le")).decode("ascii")


class WinRmTransport(Transport):
    def __init__(self, box: Box, *, timeout: float = 10.0):
        super().__init__(box)
        self._timeout = timeout
        self._protocol: Protocol | None = None
        self._shell_id: str | None = None
        self._read_timeout_s = 0

    @property
    def endpoint(self) -> str:
        host = self.box.address
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 literal
        return f"{self.box.winrm_scheme}://{host}:{self.box.effective_port}/wsman"

    @property
    def _who(self) -> str:
        return f"{self.where} as {self.box.user}"

    def _make_protocol(self) -> Protocol:
        box = self.box
        password = ""
        if box.password is not None:
            password = box.password.resolve(f"box {box.name} password")
        elif box.winrm_transport != "kerberos":  # kerberos may use the ticket cache instead
            raise FleetError(
                f"box {box.name}: WinRM with {box.winrm_transport} authentication needs a password: add "
                "'password: {env: VARIABLE}' (or '{file: PATH}') for this box in the fleet file"
            )
        # The server holds a Receive open for up to the operation timeout; the HTTP read timeout
        # must outlast it. A short operation timeout keeps run()'s own deadline responsive.
        operation_s = max(1, min(5, int(self._timeout)))
        self._read_timeout_s = operation_s + max(1, int(self._timeout))
        return Protocol(
            self.endpoint,
            transport=box.winrm_transport,
            username=box.user,
            password=password,
            server_cert_validation="ignore" if box.winrm_insecure_skip_verify else "validate",
            ca_trust_path=os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or None,
            read_timeout_sec=self._read_timeout_s,
            operation_timeout_sec=operation_s,
            proxy=None,
        )

    def _reach(self) -> None:
        """Connect once with a plain socket: tells refused, unreachable and silent apart, within the timeout."""
        address, port = self.box.address, self.box.effective_port
        try:
            with socket.create_connection((address, port), timeout=self._timeout):
                pass
        except socket.gaierror as exc:
            raise TransportError(f"{self.where}: cannot resolve {address!r} ({exc.strerror}); fix 'address' "
                                 "in the fleet file") from None
        except ConnectionRefusedError:
            raise TransportError(
                f"{self.where}: connection refused, nothing listens on port {port}; check 'port' and "
                "'winrm_scheme' (WinRM listens on 5985 for http, 5986 for https) and that the box has a "
                "WinRM listener (winrm quickconfig -transport:https)"
            ) from None
        except TimeoutError:
            raise TransportError(f"{self.where}: no answer within {self._timeout:.0f} s; check the address, "
                                 "port and firewall") from None
        except OSError as exc:
            raise TransportError(f"{self.where}: unreachable ({exc.strerror or exc}); check the address and "
                                 "the network") from None

    def _open(self) -> Protocol:
        if self._protocol is not None and self._shell_id is not None:
            return self._protocol
        self._reach()
        protocol = self._make_protocol()
        try:
            with self._translated_errors():
                self._shell_id = protocol.open_shell(codepage=UTF8_CODEPAGE, noprofile=True)
        except BaseException:
            protocol.transport.close_session()
            raise
        self._protocol = protocol
        return protocol

    def run(self, command: str, *, timeout: float = 60.0) -> CommandResult:
        """Run ``command`` as a PowerShell script; stdout and stderr come back decoded as UTF-8."""
        line = powershell_command_line(command)
        if len(line) > COMMAND_LINE_LIMIT:
            raise TransportError(
                f"{self.where}: the PowerShell script is {len(line)} characters once encoded, over cmd.exe's "
                f"{COMMAND_LINE_LIMIT}; split it into several runs"
            )
        protocol = self._open()
        assert self._shell_id is not None
        with self._translated_errors():
            command_id = protocol.run_command(self._shell_id, line)
            stdout, stderr, rc = self._receive(protocol, command_id, timeout)
            protocol.cleanup_command(self._shell_id, command_id)
        return CommandResult(stdout.decode("utf-8", errors="replace"), readable_stderr(stderr), rc)

    def _receive(self, protocol: Protocol, command_id: str, timeout: float) -> tuple[bytes, bytes, int]:
        """Poll for output until the command is done; pywinrm's own loop would wait forever."""
        assert self._shell_id is not None
        deadline = time.monotonic() + timeout
        stdout: list[bytes] = []
        stderr: list[bytes] = []
        while True:
            try:
                out, err, rc, done = protocol.get_command_output_raw(self._shell_id, command_id)
            except WinRMOperationTimeoutError:  # no output yet: the normal way a Receive ends
                out, err, rc, done = b"", b"", -1, False
            stdout.append(out)
            stderr.append(err)
            if done:
                return b"".join(stdout), b"".join(stderr), rc
            if time.monotonic() > deadline:
                with contextlib.suppress(WinRMError, WinRMTransportError, requests.RequestException):
                    protocol.cleanup_command(self._shell_id, command_id)  # terminate it on the box
                raise TransportError(f"{self.where}: command did not finish within {timeout:.0f} s")

    @contextlib.contextmanager
    def _translated_errors(self) -> Iterator[None]:
        """pywinrm and requests errors -> one TransportError line that says what to fix."""
        box = self.box
        try:
            yield
        except InvalidCredentialsError:
            hint = " (basic must also be enabled on the box's WinRM service)" if box.winrm_transport == "basic" else ""
            raise TransportError(
                f"{self._who}: the WinRM service rejected the credentials (HTTP 401, {box.winrm_transport} "
                f"authentication); check 'user', 'password' and 'winrm_transport' for this box in the fleet "
                f"file{hint}"
            ) from None
        except WSManFaultError as exc:
            raise TransportError(f"{self._who}: the WinRM service refused the request: {exc.reason.strip()}") from None
        except WinRMError as exc:
            if box.winrm_transport in _EXTRAS and "not installed" in str(exc):
                extra = _EXTRAS[box.winrm_transport]
                raise TransportError(
                    f"{self.where}: {box.winrm_transport} authentication needs {extra}: pip install '{extra}' "
                    "beside the controller, or choose another 'winrm_transport'"
                ) from None
            raise TransportError(f"{self._who}: WinRM error: {exc}") from None
        except WinRMTransportError as exc:
            raise TransportError(
                f"{self.where}: the WinRM endpoint {self.endpoint} answered HTTP {exc.code}; check 'port' and "
                "'winrm_scheme' for this box in the fleet file"
            ) from None
        except requests.exceptions.SSLError as exc:
            raise self._tls_error(exc) from None
        except requests.exceptions.Timeout:
            raise TransportError(f"{self.where}: no HTTP answer within {self._read_timeout_s} s; check that this "
                                 "port is the box's WinRM listener and that the box is not overloaded") from None
        except requests.exceptions.RequestException as exc:
            raise TransportError(f"{self.where}: connection to the WinRM service failed ({_innermost(exc)}); "
                                 "check 'winrm_scheme' and 'port' for this box in the fleet file") from None
        except (ET.ParseError, StopIteration, AssertionError, KeyError, ValueError) as exc:
            raise TransportError(f"{self.where}: the answer from {self.endpoint} is not the WS-Management this "
                                 f"client expects ({type(exc).__name__}); is this port a WinRM listener?") from None

    def _tls_error(self, exc: requests.exceptions.SSLError) -> TransportError:
        verify = _find(exc, ssl.SSLCertVerificationError)
        if verify is not None:
            reason = getattr(verify, "verify_message", None) or "certificate verify failed"
            return TransportError(
                f"{self.where}: the HTTPS certificate does not validate ({reason}); fix the certificate (one "
                f"for {self.box.address} from a CA this machine trusts), or set `winrm_insecure_skip_verify: "
                "true` for this box in the fleet file if you accept a self-signed one"
            )
        return TransportError(
            f"{self.where}: TLS handshake failed ({_innermost(exc)}); check 'winrm_scheme' (http listens on 5985, "
            "https on 5986) for this box in the fleet file"
        )

    def close(self) -> None:
        protocol, shell_id = self._protocol, self._shell_id
        self._protocol = self._shell_id = None
        if protocol is None or shell_id is None:
            return
        # Best effort: a shell left behind expires on the box by itself (its idle timeout).
        with contextlib.suppress(WinRMError, WinRMTransportError, requests.RequestException, ET.ParseError,
                                 StopIteration, AssertionError):
            protocol.close_shell(shell_id)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception and everything it wraps: requests and urllib3 nest the real error in args/reason."""
    seen: set[int] = set()
    pending: list[object] = [exc]
    while pending:
        item = pending.pop(0)
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        pending.extend([getattr(item, "reason", None), item.__cause__, item.__context__, *item.args])


def _find(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    return next((item for item in _causes(exc) if isinstance(item, kind)), None)


def _innermost(exc: BaseException) -> str:
    """The most specific message in the chain, without urllib3's pool and retry wrapping."""
    causes = list(_causes(exc))
    for item in reversed(causes):
        text = getattr(item, "strerror", None) or str(item)
        if text and "Max retries" not in text and "Connection pool" not in text:
            return text
    return str(exc)


_CLIXML_ERROR = re.compile(r'<S S="Error">(.*?)</S>', re.S)


def readable_stderr(raw: bytes) -> str:
    """PowerShell over WinRM writes stderr as CLIXML; keep the error lines, drop progress records."""
    text = raw.decode("utf-8", errors="replace")
    if not text.startswith("#< CLIXML"):
        return text
    lines = [unescape(part).replace("_x000D__x000A_", "\n") for part in _CLIXML_ERROR.findall(text)]
    return "".join(lines).strip()
