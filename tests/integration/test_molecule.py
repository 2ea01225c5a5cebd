"""Run every role's molecule scenarios against the lab's systemd image.

Scenarios read their inputs from the environment, which this test sets:
V100BOX_LAB_URL (the lab site: engine pack, SHA256SUMS, tiny model, a source tarball),
V100BOX_PACK_SHA256 (the engine pack's sha256, pinned because V100BOX_LAB_URL is plain HTTP),
V100BOX_TOKEN_URL and V100BOX_LAB_TOKEN (the site over HTTPS behind a bearer token) with V100BOX_LAB_CA (its
throwaway certificate, which a prepare playbook copies into the target),
V100BOX_MODEL_PATH / V100BOX_MODEL_SHA256 / V100BOX_MODEL_SIZE, V100BOX_SOURCE_SHA256, V100BOX_TEST_PORT,
V100BOX_APT_URL (the stand-in NVIDIA driver repository, `python -m lab.aptrepo build DIR`),
V100BOX_DRIVER_WINDOW (controller.model.rules.driver_window() as JSON: the roles take the window from the inventory),
V100BOX_NGINX_DEBS and V100BOX_HAPROXY_DEBS (folders of Debian 12's nginx and haproxy packages, fetched once on this
machine, which the lan_cache and llm_gateway scenarios install into the target before the role finds them there),
V100BOX_STANDIN_SMI (a folder with the lab's stand-in nvidia-smi, lab/standin_smi.py, and the readings it prints:
a V100 PCIe's power range and a cool sample, for thermal_guard) and V100BOX_TARGET_IMAGE. V100BOX_TEST_PORT and the
two ports above it are free on this machine when a scenario starts.
To run one by hand, serve a site with `python -m lab.fileserver` and export the same variables, then
`cd ansible_collections/v100box/llm/roles/<role> && molecule test -s <scenario>`.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from controller.model import rules
from controller.stages import strategy
from lab import aptrepo, haproxy, standin_smi
from lab.fileserver import FileServer
from lab.host import debian_packages
from lab.site import PACK_NAME, sha256_file

pytestmark = [pytest.mark.podman, pytest.mark.engine, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# The longest first (seconds each took as one `molecule test` under mitogen, three at a time on a 2-core machine, in a
# full run, 2026-11-26): the suite's workers take them in this order (tests/plugins/schedule.py), so that the last
# ones to start are short.
SCENARIOS = [
    ("llama_engine", "source"),  # 187
    ("nvidia_driver", "default"),  # 149
    ("llama_service", "exposed"),  # 135
    ("box_seal", "default"),  # 118
    ("llama_service", "default"),  # 93
    ("llm_gateway", "default"),  # 87
    ("llama_verify", "default"),  # 83
    ("lan_cache", "default"),  # 76
    ("thermal_guard", "default"),  # 76
    ("agent_clients", "default"),  # 66
    ("gguf_model", "default"),  # 59
    ("llama_engine", "default"),  # 58
]
# Each scenario is its own container on its own ports with its own molecule folder: the suite's workers run them side
# by side, a scenario a test (tests/plugins/schedule.py names this file in PER_TEST_FILES).
# nginx and what Debian 12's target image lacks of its dependencies (apt-cache depends nginx).
NGINX_DEBS = ("nginx", "nginx-common")
# What the stand-in nvidia-smi reports for thermal_guard: one V100 PCIe (its power range) at a cool 40 °C.
STANDIN_POWER = [{"index": 0, "power.min_limit": "100.00", "power.max_limit": "300.00", "power.default_limit": "250.00"}]
STANDIN_SAMPLE = [{"index": 0, "uuid": "GPU-5a7b9f1e-0000-4000-8000-000000000000", "temperature.gpu": 40,
                   "temperature.memory": 38, "power.draw": 60.5, "power.limit": 250.0, "clocks.sm": 1380,
                   "clocks.mem": 877, "clocks_throttle_reasons.active": "0x0000000000000000"}]
TOKEN = "lab-token-for-molecule"

# A CMake project standing in for llama.cpp's source: the role's build path (download, checksum,
# unpack, configure with the given flags, compile, install into the version folder) runs for real.
TINY_SOURCE = {
    "CMakeLists.txt": (
        "cmake_minimum_required(VERSION 3.16)\nproject(tiny_llama C)\n"
        'set(TINY_GREETING "tiny" CACHE STRING "")\n'
        'set(CMAKE_CUDA_ARCHITECTURES "none" CACHE STRING "")\n'
        'string(REPLACE ";" "+" TINY_ARCHS "${CMAKE_CUDA_ARCHITECTURES}")\n'
        "add_executable(llama-server server.c)\n"
        'target_compile_definitions(llama-server PRIVATE GREETING="${TINY_GREETING}" ARCHS="${TINY_ARCHS}")\n'
        "set_target_properties(llama-server PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n"
    ),
    "server.c": ('#include <stdio.h>\n'
                 'int main(void) { printf("version: %s cuda %s\\n", GREETING, ARCHS); return 0; }\n'),
}


def _source_tarball(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as archive:
        for name, text in TINY_SOURCE.items():
            data = text.encode()
            info = tarfile.TarInfo(f"tiny-llama/{name}")
            info.size, info.mode = len(data), 0o644
            archive.addfile(info, io.BytesIO(data))
    return path


def _free_ports(count: int = 3) -> int:
    """The first of ``count`` consecutive ports free on loopback (a scenario's server, gateway and metrics)."""
    while True:
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
        if port + count > 65536:
            continue
        try:
            for offset in range(1, count):
                with socket.socket() as other:
                    other.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue


def _debs(group: str, names: tuple[str, ...]) -> Path:
    """A folder of Debian 12 packages, downloaded once on this machine into ~/.cache/v100-llm-box/debs/<group>."""
    return debian_packages(group, names)


def _standin_smi(folder: Path) -> Path:
    """The stand-in nvidia-smi (as lab.standin_smi installs it) and its readings, for a prepare play to copy."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "nvidia-smi").write_text(standin_smi.standin_script())
    (folder / standin_smi.POWER_FILE).write_text(standin_smi.power_csv(STANDIN_POWER))
    (folder / standin_smi.SAMPLE_FILE).write_text(standin_smi.sample_csv(STANDIN_SAMPLE))
    return folder


@contextmanager
def scenario_environment(root: Path, catalog: Path, target_image: str) -> Iterator[dict[str, str]]:
    """The environment every scenario reads, with the lab's servers running (the site at ``root``)."""
    source = _source_tarball(root / "src" / "tiny-llama-source.tar.gz")
    model = yaml.safe_load(catalog.read_text())["models"]["tiny-llama"]
    apt_root = aptrepo.build()
    with (FileServer(root) as open_server, FileServer(root, token=TOKEN, tls=True) as token_server,
          FileServer(apt_root) as apt_server):
        yield {
            **os.environ,
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            "V100BOX_LAB_URL": open_server.url,
            "V100BOX_LAB_CA": str(token_server.ca_file),
            "V100BOX_PACK_SHA256": sha256_file(root / "engines" / PACK_NAME),
            "V100BOX_TOKEN_URL": token_server.url,
            "V100BOX_LAB_TOKEN": TOKEN,
            "V100BOX_MODEL_PATH": f"{model['repo']}/{model['file']}",  # the demo model, below the site's root
            "V100BOX_MODEL_SHA256": model["sha256"],
            "V100BOX_MODEL_SIZE": str(model["size_bytes"]),
            "V100BOX_SOURCE_SHA256": sha256_file(source),
            "V100BOX_APT_URL": apt_server.url,
            "V100BOX_DRIVER_WINDOW": json.dumps(rules.driver_window()),
            "V100BOX_NGINX_DEBS": str(_debs("nginx", NGINX_DEBS)),
            "V100BOX_HAPROXY_DEBS": str(haproxy.debs()),
            "V100BOX_STANDIN_SMI": str(_standin_smi(root / "standin-smi")),
            "V100BOX_TARGET_IMAGE": target_image,
            "ANSIBLE_FORCE_COLOR": "0",
            "PY_COLORS": "0",
        }


@pytest.fixture(scope="module")
def scenario_env(lab_site, target_image):
    root, catalog = lab_site
    with scenario_environment(root, catalog, target_image) as env:
        yield env


# One `molecule test` a scenario (its sequence: .config/molecule/config.yml), under the mitogen strategy: one Python on
# the instance for the whole play instead of two or three `podman exec` calls a task, and molecule's own start-up
# (it runs `ansible-config dump` twice and two `--version`s each time it starts, ~4 CPU-seconds) once instead of once
# a step. The instances are made by .config/molecule/create.yml (a plain `podman run`, which mitogen runs as it does
# any command). The product's own runs (the integration tests' provisions, `ansible-playbook site.yml`) keep
# Ansible's plain strategy.
# Each run keeps molecule's state (which instances exist, its inventory) in a folder of its own, new and empty, so no
# instance can be left over for the first destroy of the test sequence to remove, and the instance is removed here
# with one podman call: `--destroy=never` skips both destroy steps, two ansible-playbook runs a scenario (the
# sequence keeps them for runs by hand).
def _molecule(role: str, scenario: str, port: int, env: dict[str, str],
              state: Path) -> subprocess.CompletedProcess[str]:
    molecule_id = f"{role}-{scenario}-{port}"
    env = {**env, "V100BOX_TEST_PORT": str(port), "V100BOX_MOLECULE_ID": molecule_id,
           "MOLECULE_EPHEMERAL_DIRECTORY": str(state), **strategy.environment(strategy.MITOGEN)}
    try:
        return subprocess.run(["molecule", "test", "--scenario-name", scenario, "--destroy", "never"],
                              cwd=ROOT / "ansible_collections/v100box/llm/roles" / role, env=env,
                              capture_output=True, text=True, timeout=1500, check=False)
    finally:
        subprocess.run(["podman", "rm", "--force", "--ignore", "--time", "0", f"v100box-molecule-{molecule_id}"],
                       capture_output=True, check=False)


@pytest.mark.parametrize(("role", "scenario"), SCENARIOS, ids=[f"{r}-{s}" for r, s in SCENARIOS])
def test_molecule_scenario(role, scenario, scenario_env, tmp_path):
    done = _molecule(role, scenario, _free_ports(), scenario_env, tmp_path / "molecule")
    output = done.stdout + done.stderr
    failures = [line for line in output.splitlines() if line.startswith(("fatal:", "failed:", "ERROR!", "[ERROR]"))
                or "UNREACHABLE" in line]
    assert done.returncode == 0, "\n".join(failures[:20]) + "\n...\n" + output[-4000:]
    # molecule's idempotence step reruns converge and fails on any change; make sure it ran, under mitogen.
    assert "[default > idempotence] Executed: Successful" in output or f"[{scenario} > idempotence] Executed: Successful" \
        in output, output[-3000:]
