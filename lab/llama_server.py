"""Run the real (CPU) llama-server on a local model for tests and benchmarks, and collect its log.

The server prints its buffer sizes only at ``-lv 4``; this runner always asks for that, waits for
``/health`` to answer 200, and keeps everything the server wrote so callers can compare the
memory lines with the estimator or inspect a failure.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from lab.target import free_port


class ServerStartError(RuntimeError):
    """llama-server exited or did not become healthy; the message carries the end of its log."""


@dataclass
class RunningServer:
    url: str
    port: int
    log_path: Path
    process: subprocess.Popen[bytes]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log_path: Path, timeout: float = 120.0) -> None:
    """Return once ``url/health`` answers 200; ServerStartError when the server exits first or takes too long."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(f"llama-server exited with {process.returncode}:\n{_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise ServerStartError(f"llama-server not healthy after {timeout:.0f}s:\n{_tail(log_path)}")


def stop(process: subprocess.Popen[bytes]) -> None:
    """Terminate the server; kill it when it has not exited 15 s later."""
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def start(server: Path, args: Sequence[str], log_path: Path, url: str, *,
          timeout: float = 120.0) -> subprocess.Popen[bytes]:
    """Start ``server ARGS -lv 4`` (ARGS name its model, host and port; ``url`` is where it answers) with all it
    prints in ``log_path``, and wait until it is healthy; a server that exits or never gets healthy is stopped
    and raises ServerStartError."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen([str(server), *args, "-lv", "4"], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(url, process, log_path, timeout)
    except BaseException:
        stop(process)
        raise
    return process


@contextmanager
def serve(
    server: Path, model: Path, args: Sequence[str] = (), *, timeout: float = 120.0, threads: int = 2
) -> Iterator[RunningServer]:
    """Start ``server -m model`` on a free loopback port at log level 4; stop it on exit."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="llama-server-") as tmp:
        log_path = Path(tmp) / "server.log"
        url = f"http://127.0.0.1:{port}"
        process = start(server, ["-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
                                 *args], log_path, url, timeout=timeout)
        try:
            yield RunningServer(url, port, log_path, process)
        finally:
            stop(process)


def load_log(server: Path, model: Path, args: Sequence[str] = (), *, timeout: float = 300.0) -> str:
    """Start the server until it is healthy, stop it, and return its full log (the memory lines)."""
    with serve(server, model, args, timeout=timeout) as running:
        return running.log()
