"""Run commands over SSH with fabric (paramiko underneath)."""

from __future__ import annotations

import logging
from pathlib import Path

import paramiko
from fabric import Connection
from invoke.exceptions import CommandTimedOut

from controller.errors import TransportError
from controller.files import to_stderr
from controller.model.fleet import Box
from controller.stages.transports.base import CommandResult, Transport
from controller.stages.transports.known_hosts import HostKeyCheck, Notice, entry_name, parse_public_key

# paramiko logs a failed handshake (a web server on the SSH port, say) with its own traceback before
# it raises; the controller turns the exception into one line, so paramiko's log stays silent.
_PARAMIKO_LOG = logging.getLogger("paramiko")
_PARAMIKO_LOG.addHandler(logging.NullHandler())
_PARAMIKO_LOG.propagate = False


class SshTransport(Transport):
    def __init__(self, box: Box, *, timeout: float = 10.0, known_hosts: Path | None = None,
                 notice: Notice | None = None):
        """``known_hosts``: the inventory's known_hosts file (see controller.stages.transports.known_hosts)."""
        super().__init__(box)
        connect_kwargs: dict[str, object] = {"banner_timeout": timeout, "auth_timeout": timeout}
        if box.key is not None:
            connect_kwargs["key_filename"] = str(box.key.expanduser())
            connect_kwargs["look_for_keys"] = False
            connect_kwargs["allow_agent"] = False
        if box.password is not None:
            connect_kwargs["password"] = box.password.resolve(f"box {box.name} password")
        self._connection = Connection(
            host=box.address,
            port=box.effective_port,
            user=box.user,
            connect_timeout=timeout,
            connect_kwargs=connect_kwargs,
        )
        fleet_key = parse_public_key(box.host_key, f"box {box.name}: host_key") if box.host_key else None
        self._host_keys = HostKeyCheck(box.name, entry_name(box.address, box.effective_port), known_hosts,
                                       fleet_key, notice or to_stderr)
        self._connection.client.set_missing_host_key_policy(self._host_keys)

    def _open(self) -> None:
        if self._connection.is_connected:
            return
        who = f"{self.where} as {self.box.user}"
        self._host_keys.prepare(self._connection.client)
        try:
            self._connection.open()
        except paramiko.BadHostKeyException as exc:
            raise self._host_keys.refusal(exc.key, exc.expected_key, self.where) from None
        except paramiko.AuthenticationException:
            key = f"key {self.box.key}" if self.box.key else "the available keys"
            raise TransportError(
                f"{who}: authentication failed with {key}; check 'user' and 'key' for this box in the fleet file"
            ) from None
        except FileNotFoundError as exc:
            raise TransportError(f"{who}: key file not found: {exc.filename}; fix 'key' in the fleet file") from None
        except TimeoutError:
            raise TransportError(f"{who}: no answer within the timeout; check the address, port and firewall") from None
        except (OSError, paramiko.SSHException) as exc:
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise TransportError(f"{who}: cannot connect: {reason}; check the address and that sshd runs") from None

    def run(self, command: str, *, timeout: float = 60.0) -> CommandResult:
        self._open()
        try:
            result = self._connection.run(command, hide=True, warn=True, timeout=timeout, in_stream=False)
        except CommandTimedOut:
            raise TransportError(f"{self.where}: command did not finish within {timeout:.0f} s") from None
        except (OSError, paramiko.SSHException) as exc:
            raise TransportError(f"{self.where}: connection lost: {exc}") from None
        return CommandResult(result.stdout, result.stderr, result.return_code)

    def close(self) -> None:
        self._connection.close()
