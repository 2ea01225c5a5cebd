"""The transport interface shared by local, SSH and WinRM."""

from __future__ import annotations

import abc
from dataclasses import dataclass

from controller.model.fleet import Box


@dataclass(frozen=True)
class CommandResult:
    stdout: str
    stderr: str
    rc: int


class Transport(abc.ABC):
    """Runs one command (a shell script on Linux, PowerShell on Windows) and returns its output."""

    def __init__(self, box: Box):
        self.box = box

    @property
    def where(self) -> str:
        return f"box {self.box.name} ({self.box.address}:{self.box.effective_port})"

    @abc.abstractmethod
    def run(self, command: str, *, timeout: float = 60.0) -> CommandResult: ...

    def close(self) -> None:  # noqa: B027 - a no-op unless the transport holds a connection
        """Release the connection, if any."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
