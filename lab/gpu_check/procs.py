"""Processes the check starts, each in its own process group, all stopped however the check ends.

Everything runs through one :class:`Group`: a build, a server, strace and its server. Leaving the ``with`` block
(normally, on an error or on Ctrl-C) sends SIGTERM to every group still alive, then SIGKILL to what is left, so
the check leaves nothing running.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType


class Group:
    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Group:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop_all()

    def start(self, argv: Sequence[str], log: Path, *, cwd: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            process = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       cwd=cwd, env=env, start_new_session=True)
        self.processes.append(process)
        return process

    def stop(self, process: subprocess.Popen[bytes], *, grace: float = 15.0) -> int:
        """SIGTERM the process's group, wait, then SIGKILL it; returns the exit status."""
        if process.poll() is None:
            _signal_group(process, signal.SIGTERM)
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(process, signal.SIGKILL)  # whatever the leader left behind in its group
        rc = process.wait()
        if process in self.processes:
            self.processes.remove(process)
        return rc

    def stop_all(self) -> None:
        for process in list(self.processes):
            self.stop(process, grace=10.0)


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class NotHealthy(RuntimeError):
    pass


def wait_healthy(process: subprocess.Popen[bytes], url: str, timeout: float) -> float:
    """Seconds until ``url/health`` answers 200; raises NotHealthy when the process exits or time runs out."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            raise NotHealthy(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise NotHealthy(f"not healthy after {timeout:.0f} s")


def chat(url: str, timeout: float = 60) -> str:
    """One short chat completion, as a client would send it; returns the reply's text (garbage from a tiny model)."""
    import json

    body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        answer = json.load(reply)
    return str(answer["choices"][0]["message"].get("content", ""))


def children(pid: int) -> list[int]:
    """The direct children of a process (Linux /proc)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            continue
    return found
