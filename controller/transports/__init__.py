"""Ways to run read-only commands on a box: locally, over SSH (fabric) or WinRM (pywinrm)."""

from __future__ import annotations

from controller.fleet import Box
from controller.transports.base import CommandResult, Transport


def open_transport(box: Box, *, timeout: float = 10.0) -> Transport:
    """The transport the fleet file asks for, connected lazily on first use."""
    if box.transport == "local":
        from controller.transports.local import LocalTransport

        return LocalTransport(box)
    if box.transport == "ssh":
        from controller.transports.ssh import SshTransport

        return SshTransport(box, timeout=timeout)
    from controller.transports.winrm import WinRmTransport

    return WinRmTransport(box, timeout=timeout)


__all__ = ["CommandResult", "Transport", "open_transport"]
