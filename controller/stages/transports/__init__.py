"""Ways to run read-only commands on a box: locally, over SSH (fabric) or WinRM (pywinrm)."""

from __future__ import annotations

from pathlib import Path

from controller.model.fleet import Box
from controller.stages.transports.base import CommandResult, Transport


def open_transport(box: Box, *, timeout: float = 10.0, known_hosts: Path | None = None) -> Transport:
    """The transport the fleet file asks for, connected lazily on first use.

    ``known_hosts``: where SSH host keys are checked and recorded (the inventory's known_hosts file);
    without it an SSH box is checked only against ``host_key`` from the fleet file.
    """
    if box.transport == "local":
        from controller.stages.transports.local import LocalTransport

        return LocalTransport(box)
    if box.transport == "ssh":
        from controller.stages.transports.ssh import SshTransport

        return SshTransport(box, timeout=timeout, known_hosts=known_hosts)
    from controller.stages.transports.winrm import WinRmTransport

    return WinRmTransport(box, timeout=timeout)


__all__ = ["CommandResult", "Transport", "open_transport"]
