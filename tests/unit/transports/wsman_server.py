"""A real WS-Management endpoint on 127.0.0.1 that answers the way a Windows WinRM service does.

It speaks the shell subset pywinrm uses (Create shell, Command, Receive, Signal, Delete shell) as
SOAP 1.2 over HTTP or HTTPS with basic authentication, or NTLM over HTTPS (a real NTLM acceptor from
pyspnego, bound to the TLS channel as Windows' Extended Protection does), so the transport is exercised through its real
HTTP, TLS and XML layers. Windows itself is stood in for by :class:`StandInWindows`: it decodes
the ``-EncodedCommand`` script it is sent, and for each probe section answers with a captured output
from a fixture folder, as the native tool would have printed it.

Behaviour that real servers show and the client must cope with is reproduced: a Receive that ends
in an OperationTimeout fault before any output, output spread over several Receives, CLIXML progress
noise on stderr, a 401 with an empty body for bad credentials.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import re
import socket
import ssl
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from xml.sax.saxutils import escape

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from spnego import ContextProxy
from spnego import server as spnego_server
from spnego.channel_bindings import GssChannelBindings
from spnego.exceptions import SpnegoError

from controller.stages.probe.commands import OUTPUT_MARKER
from controller.stages.probe.windows_collect import SECTION_FUNCTION

NS = {
    "s": "http://www.w3.org/2003/05/soap-envelope",
    "a": "http://schemas.xmlsoap.org/ws/2004/08/addressing",
    "w": "http://schemas.dmtf.org/wbem/wsman/1/wsman.xsd",
    "rsp": "http://schemas.microsoft.com/wbem/wsman/1/windows/shell",
    "x": "http://schemas.xmlsoap.org/ws/2004/09/transfer",
}
SHELL_URI = "http://schemas.microsoft.com/wbem/wsman/1/windows/shell"
CREATE = "http://schemas.xmlsoap.org/ws/2004/09/transfer/Create"
DELETE = "http://schemas.xmlsoap.org/ws/2004/09/transfer/Delete"
COMMAND = f"{SHELL_URI}/Command"
RECEIVE = f"{SHELL_URI}/Receive"
SIGNAL = f"{SHELL_URI}/Signal"
TERMINATE = f"{SHELL_URI}/signal/terminate"
OPERATION_TIMEOUT_CODE = "2150858793"
CMD_LINE_LIMIT = 8191
PROGRESS_CLIXML = (
    '#< CLIXML\r\n<Objs Version="1.1.0.1" xmlns="http://schemas.microsoft.com/powershell/2004/04">'
    '<Obj S="progress" RefId="0"><TN RefId="0"><T>System.Management.Automation.PSCustomObject</T>'
    "<T>System.Object</T></TN><MS><I64 N=\"SourceId\">1</I64><PR N=\"Record\"><AV>Preparing modules for "
    "first use.</AV><AI>0</AI><Nil /><PI>-1</PI><PC>-1</PC><T>Completed</T><SR>-1</SR><SD> </SD></PR>"
    "</MS></Obj></Objs>"
)


# ------------------------------------------------------------------------------------------ TLS


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path


def self_signed_certificate(folder: Path, host: str = "127.0.0.1") -> TlsFiles:
    """A self-signed certificate for ``host`` (what New-SelfSignedCertificate gives a WinRM listener)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "winrm-test-host")])
    now = datetime.datetime.now(datetime.UTC)
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    files = TlsFiles(folder / "winrm-cert.pem", folder / "winrm-key.pem")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
    return files


# ------------------------------------------------------------------------------ stand-in Windows


_SECTION = re.compile(rf"^{SECTION_FUNCTION} '([^']+)' {{\n(.*?)\n}}$", re.M | re.S)
_NATIVE = re.compile(r"& nvidia-smi\.exe([^\n]*?) 2>\$null")


@dataclass
class StandInWindows:
    """Answers a probe script with fixture outputs, section by section, as PowerShell would print them.

    A section that runs ``nvidia-smi.exe ARGS`` gets the fixture file for those arguments (the
    contract's file names); the CIM section gets ``windows-cim.json``. A section the stand-in does
    not recognise, or whose fixture is missing, prints nothing, like a missing tool.
    """

    fixtures: Path
    scripts: list[str] = field(default_factory=list)

    def run(self, command_line: str) -> tuple[bytes, bytes, int]:
        match = re.fullmatch(r"powershell\.exe -NoProfile -NonInteractive -EncodedCommand ([A-Za-z0-9+/=]+)",
                             command_line)
        if match is None:
            return b"", f"'{command_line[:40]}' is not recognized as a command".encode(), 1
        script = base64.b64decode(match.group(1)).decode("utf-16-le")
        self.scripts.append(script)
        out = []
        for name, body in _SECTION.findall(script):
            out.append(f"\n{OUTPUT_MARKER}{name}\n")
            text = self._section_output(body)
            if text:
                out.append("\n".join(text.replace("\r\n", "\n").splitlines()) + "\n")
        return "".join(out).encode("utf-8"), PROGRESS_CLIXML.encode(), 0

    def _section_output(self, body: str) -> str:
        native = _NATIVE.search(body)
        if native is not None:
            arguments = native.group(1).strip()
            file = ("nvidia-smi-query.csv" if arguments.startswith("--query-gpu=") else
                    {"": "nvidia-smi.txt", "topo -m": "nvidia-smi-topo.txt",
                     "nvlink -s": "nvidia-smi-nvlink.txt"}.get(arguments))
        elif "Get-CimInstance Win32_Processor" in body and "ConvertTo-Json" in body:
            file = "windows-cim.json"
        else:
            file = None
        path = self.fixtures / file if file else None
        return path.read_text() if path is not None and path.is_file() else ""


# --------------------------------------------------------------------------------- the endpoint


@dataclass
class Command:
    command_id: str
    stdout: bytes
    stderr: bytes
    rc: int
    receives: int = 0
    terminated: bool = False


class WsmanServer:
    """``with WsmanServer(host, user=..., password=..., tls=...) as server:`` -> ``server.port``.

    ``actions`` records every SOAP action received, in order; ``handshake_failures`` counts TLS
    handshakes a client gave up on. ``hang`` makes every Receive report "still running" forever.
    ``auth="ntlm"`` takes the accounts from the file named by ``$NTLM_USER_FILE`` (pyspnego's
    acceptor reads it; lines ``DOMAIN:USER:PASSWORD``).
    """

    def __init__(self, windows: StandInWindows, *, user: str, password: str, tls: TlsFiles | None = None,
                 hang: bool = False, auth: str = "basic") -> None:
        self.windows = windows
        self.expected_auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.auth = auth
        self.ntlm_logins: list[str] = []
        self.tls = tls
        self.hang = hang
        self.actions: list[str] = []
        self.auth_failures = 0
        self.handshake_failures = 0
        self.shells: set[str] = set()
        self.commands: dict[str, Command] = {}
        self._lock = threading.Lock()
        self._httpd = _Server(("127.0.0.1", 0), _Handler, self)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="wsman", daemon=True)

    def __enter__(self) -> WsmanServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    # -- SOAP ----------------------------------------------------------------------------------

    def handle(self, body: bytes) -> tuple[int, str]:
        root = ET.fromstring(body)
        action = root.findtext("s:Header/a:Action", namespaces=NS) or ""
        message_id = root.findtext("s:Header/a:MessageID", namespaces=NS) or ""
        shell_id = root.findtext("s:Header/w:SelectorSet/w:Selector[@Name='ShellId']", namespaces=NS)
        with self._lock:
            self.actions.append(action.rsplit("/", 1)[-1])
            if action == CREATE:
                return 200, self._created(action, message_id)
            if shell_id not in self.shells:
                return 500, _fault(action, message_id, "w:InvalidSelectors", "2150858843",
                                   "The request for the Windows Remote Shell with ShellId failed because the shell "
                                   "was not found on the server.")
            if action == COMMAND:
                return 200, self._command(root, action, message_id)
            if action == RECEIVE:
                return self._receive(root, action, message_id)
            if action == SIGNAL:
                command_id = root.find("s:Body/rsp:Signal", NS).get("CommandId")
                code = root.findtext("s:Body/rsp:Signal/rsp:Code", namespaces=NS)
                self.commands[command_id].terminated = code == TERMINATE
                return 200, _envelope(action, message_id, "<rsp:SignalResponse/>")
            if action == DELETE:
                self.shells.discard(shell_id)
                return 200, _envelope(action, message_id, "")
        return 500, _fault(action, message_id, "a:ActionNotSupported", "2150858771", "Unknown action")

    def _created(self, action: str, message_id: str) -> str:
        shell_id = str(uuid.uuid4()).upper()
        self.shells.add(shell_id)
        body = (f"<x:ResourceCreated><a:Address>https://127.0.0.1:{self.port}/wsman</a:Address>"
                "<a:ReferenceParameters><w:ResourceURI>http://schemas.microsoft.com/wbem/wsman/1/windows/shell/cmd"
                f"</w:ResourceURI><w:SelectorSet><w:Selector Name=\"ShellId\">{shell_id}</w:Selector></w:SelectorSet>"
                f"</a:ReferenceParameters></x:ResourceCreated><rsp:Shell><rsp:ShellId>{shell_id}</rsp:ShellId>"
                "<rsp:State>Connected</rsp:State></rsp:Shell>")
        return _envelope(action, message_id, body)

    def _command(self, root: ET.Element, action: str, message_id: str) -> str:
        line = root.findtext("s:Body/rsp:CommandLine/rsp:Command", namespaces=NS) or ""
        arguments = root.findtext("s:Body/rsp:CommandLine/rsp:Arguments", namespaces=NS)
        if arguments:
            line = f"{line} {arguments}"
        if len(line) > CMD_LINE_LIMIT:  # cmd.exe refuses longer lines
            stdout, stderr, rc = b"", b"The command line is too long.\r\n", 1
        else:
            stdout, stderr, rc = self.windows.run(line)
        command_id = str(uuid.uuid4()).upper()
        self.commands[command_id] = Command(command_id, stdout, stderr, rc)
        return _envelope(action, message_id,
                         f"<rsp:CommandResponse><rsp:CommandId>{command_id}</rsp:CommandId></rsp:CommandResponse>")

    def _receive(self, root: ET.Element, action: str, message_id: str) -> tuple[int, str]:
        command_id = root.find("s:Body/rsp:Receive/rsp:DesiredStream", NS).get("CommandId")
        command = self.commands[command_id]
        command.receives += 1
        if self.hang or command.receives == 1:  # the first Receive outlasts OperationTimeout
            time.sleep(0.05)
            return 500, _fault(action, message_id, "w:TimedOut", OPERATION_TIMEOUT_CODE,
                               "The WS-Management service cannot complete the operation within the time "
                               "specified in OperationTimeout.")
        half = len(command.stdout) // 2
        if command.receives == 2:  # part of the output while the command still runs
            streams = _stream("stdout", command_id, command.stdout[:half])
            state = f'<rsp:CommandState CommandId="{command_id}" State="{SHELL_URI}/CommandState/Running"/>'
        else:
            streams = (_stream("stdout", command_id, command.stdout[half:])
                       + _stream("stderr", command_id, command.stderr)
                       + f'<rsp:Stream Name="stdout" CommandId="{command_id}" End="true"></rsp:Stream>'
                       + f'<rsp:Stream Name="stderr" CommandId="{command_id}" End="true"></rsp:Stream>')
            state = (f'<rsp:CommandState CommandId="{command_id}" State="{SHELL_URI}/CommandState/Done">'
                     f"<rsp:ExitCode>{command.rc}</rsp:ExitCode></rsp:CommandState>")
        return 200, _envelope(action, message_id, f"<rsp:ReceiveResponse>{streams}{state}</rsp:ReceiveResponse>")


def _stream(name: str, command_id: str, data: bytes) -> str:
    if not data:
        return ""
    return f'<rsp:Stream Name="{name}" CommandId="{command_id}">{base64.b64encode(data).decode()}</rsp:Stream>'


def _namespaces() -> str:
    return " ".join(f'xmlns:{prefix}="{uri}"' for prefix, uri in NS.items())


def _envelope(action: str, message_id: str, body: str) -> str:
    return (f'<s:Envelope xml:lang="en-US" {_namespaces()}><s:Header>'
            f"<a:Action>{escape(action)}Response</a:Action><a:MessageID>uuid:{uuid.uuid4()}</a:MessageID>"
            "<a:To>http://schemas.xmlsoap.org/ws/2004/08/addressing/role/anonymous</a:To>"
            f"<a:RelatesTo>{escape(message_id)}</a:RelatesTo></s:Header><s:Body>{body}</s:Body></s:Envelope>")


def _fault(action: str, message_id: str, subcode: str, code: str, text: str) -> str:
    body = (f"<s:Fault><s:Code><s:Value>s:Receiver</s:Value><s:Subcode><s:Value>{subcode}</s:Value></s:Subcode>"
            f'</s:Code><s:Reason><s:Text xml:lang="en-US">{escape(text)}</s:Text></s:Reason><s:Detail>'
            f'<f:WSManFault xmlns:f="http://schemas.microsoft.com/wbem/wsman/1/wsmanfault" Code="{code}" '
            f'Machine="winrm-test-host"><f:Message>{escape(text)}</f:Message></f:WSManFault></s:Detail></s:Fault>')
    return (f'<s:Envelope xml:lang="en-US" {_namespaces()}><s:Header>'
            "<a:Action>http://schemas.dmtf.org/wbem/wsman/1/wsman/fault</a:Action>"
            f"<a:MessageID>uuid:{uuid.uuid4()}</a:MessageID><a:RelatesTo>{escape(message_id)}</a:RelatesTo>"
            f"</s:Header><s:Body>{body}</s:Body></s:Envelope>")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], owner: WsmanServer):
        self.owner = owner
        self.tls_context: ssl.SSLContext | None = None
        if owner.tls is not None:
            self.tls_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.tls_context.load_cert_chain(owner.tls.cert, owner.tls.key)
        super().__init__(address, handler)

    def get_request(self) -> tuple[socket.socket, object]:
        sock, address = self.socket.accept()
        if self.tls_context is None:
            return sock, address
        sock.settimeout(5)
        try:
            return self.tls_context.wrap_socket(sock, server_side=True), address
        except (ssl.SSLError, OSError):
            self.owner.handshake_failures += 1
            sock.close()
            raise


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as WinRM clients expect
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass

    ntlm_user: str | None = None  # NTLM authenticates the connection, not each request
    ntlm_context: ContextProxy | None = None

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        owner = self.server.owner
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path != "/wsman":
            return self._reply(404, "")
        if owner.auth == "ntlm":
            if not self._ntlm_authenticated(owner):
                return
        elif self.headers.get("Authorization") != owner.expected_auth:
            owner.auth_failures += 1
            return self._reply(401, "", {"WWW-Authenticate": 'Basic realm="WSMAN"'})
        status, text = owner.handle(body)
        self._reply(status, text)

    def _ntlm_authenticated(self, owner: WsmanServer) -> bool:
        """One NTLM leg per request: negotiate -> challenge (401), authenticate -> the request is served."""
        if self.ntlm_user is not None:
            return True
        header = self.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme not in ("NTLM", "Negotiate") or not token:
            self._reply(401, "", {"WWW-Authenticate": "Negotiate"}, also={"WWW-Authenticate": "NTLM"})
            return False
        if self.ntlm_context is None:
            der = ssl.PEM_cert_to_DER_cert(owner.tls.cert.read_text()) if owner.tls else None
            bindings = (GssChannelBindings(application_data=b"tls-server-end-point:" + hashlib.sha256(der).digest())
                        if der else None)
            self.ntlm_context = spnego_server(protocol="ntlm", channel_bindings=bindings)
        try:
            answer = self.ntlm_context.step(base64.b64decode(token))
        except SpnegoError:
            owner.auth_failures += 1
            self.ntlm_context = None
            self._reply(401, "", {"WWW-Authenticate": "Negotiate"}, also={"WWW-Authenticate": "NTLM"})
            return False
        if not self.ntlm_context.complete:
            self._reply(401, "", {"WWW-Authenticate": f"{scheme} {base64.b64encode(answer or b'').decode()}"})
            return False
        self.ntlm_user = self.ntlm_context.client_principal
        owner.ntlm_logins.append(self.ntlm_user)
        return True

    def _reply(self, status: int, text: str, headers: dict[str, str] | None = None,
               also: dict[str, str] | None = None) -> None:
        data = text.encode("utf-8")
        self.send_response(status)
        if data:
            self.send_header("Content-Type", "application/soap+xml;charset=UTF-8")
        for extra in (headers or {}, also or {}):  # `also` repeats a header name, as WinRM's 401 does
            for key, value in extra.items():
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
