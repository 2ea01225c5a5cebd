"""Run commands on this machine."""

from __future__ import annotations

import subprocess

from controller.errors import TransportError
from controller.stages.transports.base import CommandResult, Transport


class LocalTransport(Transport):
    def run(self, command: str, *, timeout: float = 60.0) -> CommandResult:
        try:
            done = subprocess.run(
                ["/bin/sh", "-c", command], capture_output=True, text=True, errors="replace", timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            raise TransportError(f"{self.where}: command did not finish within {timeout:.0f} s") from None
        return CommandResult(done.stdout, done.stderr, done.returncode)
