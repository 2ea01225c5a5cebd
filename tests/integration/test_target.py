"""The lab's systemd target is a usable Linux box: systemd as PID 1, key-only root SSH on a private
loopback port, host networking, clean removal, and the shared molecule platform built on it."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lab import target as lab_target

REPO = Path(__file__).resolve().parents[2]


def run(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def port_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_systemd_is_pid_1_and_boots_clean(systemd_target: lab_target.Target) -> None:
    assert systemd_target.exec(["ps", "-p", "1", "-o", "comm="]).strip() == "systemd"
    state = systemd_target.run(["systemctl", "is-system-running"]).stdout.strip()
    assert state == "running", systemd_target.list_failed_units()
    assert systemd_target.exec("systemctl show -p Virtualization --value").strip() == "podman"


def test_root_logs_in_with_the_lab_key_only(systemd_target: lab_target.Target, tmp_path: Path) -> None:
    done = run(systemd_target.ssh_argv("id", "-u"), timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"

    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    argv = systemd_target.ssh_argv("true")
    argv[argv.index(str(systemd_target.key))] = str(stranger)
    refused = run(argv, timeout=30)
    assert refused.returncode == 255 and "Permission denied" in refused.stderr
    # Password and keyboard-interactive logins are off, so a key is the only way in.
    assert "Permission denied (publickey)" in refused.stderr


def test_sshd_listens_only_on_its_loopback_port(systemd_target: lab_target.Target) -> None:
    listeners = systemd_target.exec("ss -Hltnp | grep sshd").splitlines()
    addresses = {line.split()[3] for line in listeners}
    assert addresses == {f"127.0.0.1:{systemd_target.ssh_port}"}


def test_loopback_service_inside_is_reachable_from_the_host(systemd_target: lab_target.Target) -> None:
    port = lab_target.free_port()
    token = secrets.token_hex(8)
    systemd_target.exec(f"mkdir -p /srv/probe && echo {token} > /srv/probe/token")
    systemd_target.exec([
        "systemd-run", "--unit", f"probe-{port}", "--property", "DynamicUser=yes",
        "/usr/bin/python3", "-m", "http.server", "--bind", "127.0.0.1",
        "--directory", "/srv/probe", str(port),
    ])
    deadline = time.monotonic() + 20
    while not port_answers(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/token", timeout=10) as response:
        assert response.read().decode().strip() == token


def test_two_targets_run_side_by_side_and_stop_removes_them(target_factory) -> None:
    first, second = target_factory(), target_factory()
    assert first.ssh_port != second.ssh_port
    ids = {t.exec("cat /etc/machine-id").strip() for t in (first, second)}
    assert len(ids) == 2 and "" not in ids
    for one in (first, second):
        done = run(one.ssh_argv("hostname"), timeout=30)
        assert done.stdout.strip() == one.name

    started = time.monotonic()
    first.stop()
    assert time.monotonic() - started < 15
    assert not lab_target.container_exists(first.name)
    assert not port_answers(first.ssh_port)
    assert lab_target.container_exists(second.name)
    first.stop()  # stopping twice is harmless


def test_sweeper_removes_targets_whose_owner_is_gone(target_image: str) -> None:
    child = subprocess.Popen(["sleep", "60"])
    dead_owner = lab_target.owner_token(child.pid)
    child.kill()
    child.wait()
    orphan = lab_target.Target.start(image=target_image, owner=dead_owner)
    try:
        with lab_target.Target.start(image=target_image) as ours:
            # Sessions running beside this one sweep too, so check the outcome, not who swept.
            assert ours.name not in lab_target.cleanup_stale()
            assert not lab_target.container_exists(orphan.name)
            assert lab_target.container_exists(ours.name)
    finally:
        orphan.stop()


def test_cli_up_status_down(target_image: str) -> None:
    name = f"v100box-target-cli-{secrets.token_hex(3)}"
    python = [sys.executable, "-m", "lab.target_cli"]
    try:
        up = run([*python, "up", "--name", name], timeout=180)
        assert up.returncode == 0, up.stderr
        ssh_line = up.stdout.splitlines()[-1].split()
        assert ssh_line[0] == "ssh"
        done = run([*ssh_line, "echo", "ok"], timeout=30)
        assert done.stdout.strip() == "ok", done.stderr
        # A manual target outlives the process that started it and survives the sweeper.
        assert name not in lab_target.cleanup_stale()
        status = run([*python, "status"], timeout=60)
        assert name in status.stdout and "owner=manual" in status.stdout
        down = run([*python, "down", name], timeout=60)
        assert down.returncode == 0 and name in down.stdout
        assert not lab_target.container_exists(name)
    finally:
        lab_target.remove_containers([name])


@pytest.mark.slow
def test_molecule_smoke_scenario_passes_on_the_shared_platform(target_image: str) -> None:
    molecule = Path(sys.executable).with_name("molecule")
    if not molecule.exists():
        pytest.fail(f"molecule is not installed beside {sys.executable}: pip install -e '.[test]'")
    port = lab_target.free_port()
    env = {
        **os.environ,
        "V100BOX_TARGET_IMAGE": target_image,
        "V100BOX_SMOKE_PORT": str(port),
        "V100BOX_MOLECULE_ID": f"smoke-{port}",  # other sessions may run scenarios at the same time
        "PATH": f"{molecule.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "NO_COLOR": "1",
        "PY_COLORS": "0",
        "ANSIBLE_FORCE_COLOR": "0",
    }
    done = subprocess.run(
        [str(molecule), "--base-config", str(REPO / ".config/molecule/config.yml"), "test"],
        cwd=REPO / "tests/molecule_smoke", env=env, check=False, capture_output=True, text=True, timeout=600,
    )
    output = done.stdout + done.stderr
    failures = [line for line in output.splitlines() if line.startswith(("fatal:", "failed:", "ERROR"))]
    assert done.returncode == 0, "\n".join(failures[:20]) + "\n...\n" + output[-4000:]
    for step in ("create", "converge", "idempotence", "verify", "destroy"):
        assert f"[default > {step}] Executed: Successful" in output, output[-4000:]
