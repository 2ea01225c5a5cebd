"""Issue 20, first boot: the NVIDIA device nodes exist before a sandboxed llama server starts, and its sandbox opens
them (and nothing else of the driver's) by their minor numbers.

A real systemd target (a privileged podman container with its own cgroup namespace, lab.target, so that its systemd
enforces device policies on a cgroup v1 host too) gets the lab's stand-in ``nvidia-modprobe``
(lab.aptrepo), which loads nothing but makes the nodes the real one makes: character devices with the driver's
numbers and no driver behind them. The roles (llama_engine, gguf_model, llama_service) run one server as the
controller renders a GPU service: its card is nvidia-smi's GPU 0 but its node has minor number 1, it is named to CUDA
by UUID, and its build compiles nothing at run time (MemoryDenyWriteExecute=yes); the engine is the lab's CPU build,
so nothing opens the nodes but the test. A drop-in adds one ExecStartPost= that opens the nodes from inside the
server's own sandbox (its device policy, user and system-call filter) and logs what the kernel answered.

Then the container restarts, which is a cold boot for /dev: no NVIDIA node exists until the boot unit makes one. The
test reads that boot: the unit found none and made them, the server started after it had finished, and in the
server's sandbox the allowed nodes pass the device policy (ENXIO: no driver behind them in the lab) while
nvidia-uvm-tools, made too but not allowed, is refused (EPERM). A control shows why the order matters: a unit started
before its node existed is refused the node made later, because systemd resolved the path when it started.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lab import aptrepo
from lab.engine_build import sha256_file
from lab.site import DEMO_MODELS, MODEL_REPO, PACK_NAME
from lab.target import Target, free_port

pytestmark = [pytest.mark.podman, pytest.mark.engine, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SERVICE = "llama-nodes"
NODES_UNIT = "v100box-nvidia-nodes.service"
UUID = "GPU-5a7b9f1e-0000-4000-8000-000000000001"
MINOR = 1  # the driver made this card's node second: nvidia-smi's GPU 0 is /dev/nvidia1
OPENER = "/usr/local/lib/v100box-lab/open-nodes.py"
OPEN_NODES = """import errno, os, sys
for path in sys.argv[1:]:
    try:
        os.close(os.open(path, os.O_RDWR))
        answer = "opened"
    except OSError as exc:
        answer = errno.errorcode.get(exc.errno, str(exc.errno))
    print(f"lab-open {path} {answer}", flush=True)
"""
# Test instrumentation only: the product's unit is left as the role wrote it.
DROP_IN = f"""[Service]
ExecStartPost=/usr/bin/python3 {OPENER} /dev/nvidia{MINOR} /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools
"""
PLAY = """
- hosts: all
  gather_facts: true
  gather_subset: ["!all"]
  roles:
    - role: v100box.llm.llama_engine
    - role: v100box.llm.gguf_model
    - role: v100box.llm.llama_service
"""


def _journal(target, unit: str) -> list[str]:
    """What the unit's current activation logged (a container shares the host's boot id, so -b cannot tell)."""
    invocation = target.exec(f"systemctl show -p InvocationID --value {unit}").strip()
    if not invocation:
        return []
    return target.exec(f"journalctl _SYSTEMD_INVOCATION_ID={invocation} -o cat --no-pager").splitlines()


def _open_lines(target, unit: str) -> dict[str, str]:
    return {line.split()[1]: line.split()[2] for line in _journal(target, unit) if line.startswith("lab-open ")}


def _wait(what: str, check, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.5)


def _show(target, unit: str, prop: str) -> str:
    return target.exec(f"systemctl show -p {prop} --value {unit}").strip()


@pytest.fixture(scope="module")
def systemd_target(target_image):
    """A target whose systemd enforces each unit's device policy (see lab.target.Target.start's cgroupns)."""
    with Target.start(image=target_image, cgroupns="private") as started:
        yield started


@pytest.fixture(scope="module")
def box(systemd_target, site_server, lab_site, tmp_path_factory):
    server, _catalog = site_server
    root, _ = lab_site
    folder = tmp_path_factory.mktemp("nodes")
    port = free_port()
    model = DEMO_MODELS[0]
    systemd_target.exec("cat > /usr/bin/nvidia-modprobe && chmod 755 /usr/bin/nvidia-modprobe",
                        input=aptrepo.NVIDIA_MODPROBE)
    assert systemd_target.run("ls /dev/nvidia*").returncode != 0, "the target has NVIDIA nodes before the test"
    variables = {
        "llama_engine_packs": [{"name": "cpu", "version": "0c1e570", "url": f"{server.url}/engines/{PACK_NAME}",
                                "sha256": sha256_file(root / "engines" / PACK_NAME)}],
        "gguf_model_files": [{"name": "tiny.gguf", "url": f"{server.url}/{MODEL_REPO}/{model.file}",
                              "sha256": sha256_file(root / MODEL_REPO / model.file)}],
        "gguf_model_dir": "/var/lib/llama/models",
        "llama_service_template_dir": "/etc/llama/templates",
        "llama_service_gpus": [{"index": 0, "name": "Tesla V100-SXM2-32GB", "uuid": UUID, "minor_number": MINOR}],
        # As controller/stages/render.py projects a planned GPU service (controller/stages/planner/sandbox.py decides).
        "llama_service_instances": [{
            "name": SERVICE, "model": "tiny", "engine": "cpu", "port": port,
            "args": ["--model", "/var/lib/llama/models/tiny.gguf", "--alias", "tiny", "--port", str(port),
                     "--ctx-size", "512", "--threads", "1"],
            "env": {"CUDA_VISIBLE_DEVICES": UUID}, "gpu_minors": [MINOR], "memory_deny_write_execute": True}],
    }
    (folder / "hosts.yml").write_text(yaml.safe_dump({"all": {"hosts": {"box": systemd_target.ansible_host_vars()}}}))
    (folder / "vars.yml").write_text(yaml.safe_dump(variables))
    (folder / "play.yml").write_text(PLAY)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}

    def run() -> str:
        done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(folder / "hosts.yml"),
                               "-e", f"@{folder / 'vars.yml'}", str(folder / "play.yml")], cwd=ROOT, env=env,
                              capture_output=True, text=True, check=False, timeout=600)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        return done.stdout

    run()
    systemd_target.exec(f"mkdir -p {os.path.dirname(OPENER)} && cat > {OPENER} && chmod 644 {OPENER}",
                        input=OPEN_NODES)
    systemd_target.exec(f"mkdir -p /etc/systemd/system/{SERVICE}.service.d && "
                        f"cat > /etc/systemd/system/{SERVICE}.service.d/50-lab-open-nodes.conf", input=DROP_IN)
    systemd_target.exec("systemctl daemon-reload")
    return {"target": systemd_target, "port": port, "run": run}


def test_the_role_installs_the_boot_unit_and_orders_the_server_after_it(box):
    target = box["target"]
    assert target.exec(f"systemctl is-enabled {NODES_UNIT}").strip() == "enabled"
    assert NODES_UNIT in _show(target, f"{SERVICE}.service", "Requires").split()
    assert NODES_UNIT in _show(target, f"{SERVICE}.service", "After").split()
    assert _show(target, f"{SERVICE}.service", "MemoryDenyWriteExecute") == "yes"
    # Made during the run: the card's node with the driver's major (195 = 0xc3) and the card's minor number.
    assert target.exec(f"stat -c '%F %t:%T' /dev/nvidia{MINOR} /dev/nvidiactl").splitlines() == [
        f"character special file c3:{MINOR:x}", "character special file c3:ff"]


def test_a_second_run_changes_nothing(box):
    recap = next(line for line in box["run"]().splitlines() if line.startswith("box "))
    assert " changed=0 " in recap and " failed=0 " in recap, recap


def test_at_a_cold_boot_the_nodes_are_made_before_the_server_starts_and_its_sandbox_opens_them(box):
    target, port = box["target"], box["port"]
    before = target.exec(f"systemctl show -p InvocationID --value {NODES_UNIT}").strip()

    subprocess.run(["podman", "restart", "--time", "5", target.name], check=True, capture_output=True, timeout=120)
    _wait("booted systemd", lambda: target.run("systemctl is-system-running --wait").stdout.strip()
          in ("running", "degraded"))
    _wait(f"{SERVICE} answering /health", lambda: target.run(
        f"python3 -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=2)\""
    ).returncode == 0)

    # None of the nodes existed at this boot: the boot unit made each of them.
    assert _show(target, NODES_UNIT, "InvocationID") not in ("", before)
    made = _journal(target, NODES_UNIT)
    for node in (f"/dev/nvidia{MINOR}", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"):
        assert f"{node} made" in made, made
    assert not any(line.endswith(" existed") for line in made), made

    # The server started once the boot unit had finished.
    finished = int(_show(target, NODES_UNIT, "ActiveEnterTimestampMonotonic"))
    started = int(_show(target, f"{SERVICE}.service", "ExecMainStartTimestampMonotonic"))
    assert 0 < finished <= started, (finished, started)
    assert _show(target, f"{SERVICE}.service", "NRestarts") == "0"

    # In the server's sandbox: its nodes pass the device policy (no driver in the lab: ENXIO), the rest is refused.
    assert _open_lines(target, f"{SERVICE}.service") == {
        f"/dev/nvidia{MINOR}": "ENXIO", "/dev/nvidiactl": "ENXIO", "/dev/nvidia-uvm": "ENXIO",
        "/dev/nvidia-uvm-tools": "EPERM"}


def test_a_node_made_after_its_unit_started_stays_closed(box):
    """Why the order matters: systemd resolves DeviceAllow= when the unit starts and skips a node not there yet."""
    target = box["target"]
    late = "/dev/nvidia9"
    target.run(f"rm -f {late}")
    # RemainAfterExit= keeps each transient unit (and its invocation's journal) after its process ends.
    target.exec("systemd-run --unit=lab-late-node -p RemainAfterExit=yes -p DevicePolicy=closed "
                f"-p 'DeviceAllow={late} rw' /usr/bin/python3 -c "
                f"\"import os, time; [time.sleep(0.1) for _ in iter(lambda: os.path.exists('{late}'), True)]; "
                f"exec(open('{OPENER}').read(), {{'__name__': '__main__'}})\" {late} /dev/nvidia{MINOR}")
    target.exec(f"sleep 1; mknod -m 666 {late} c 195 9")
    lines = _wait("the late unit's answer", lambda: _open_lines(target, "lab-late-node.service") or None, timeout=30)
    # The node it names was made after it started: refused, like a node its list never named.
    assert lines == {late: "EPERM", f"/dev/nvidia{MINOR}": "EPERM"}
    # The same unit started once the node exists gets through to the (missing) driver.
    target.exec(f"systemd-run --unit=lab-early-node -p RemainAfterExit=yes -p DevicePolicy=closed "
                f"-p 'DeviceAllow={late} rw' "
                f"/usr/bin/python3 {OPENER} {late}")
    lines = _wait("the early unit's answer", lambda: _open_lines(target, "lab-early-node.service") or None, timeout=30)
    assert lines == {late: "ENXIO"}
    target.run(f"systemctl stop lab-late-node lab-early-node; rm -f {late}")
