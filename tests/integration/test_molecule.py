"""Run every role's molecule scenarios against the lab's systemd image.

Scenarios read their inputs from the environment, which this test sets:
V100BOX_LAB_URL (the lab site: engine pack, SHA256SUMS, tiny model, a source tarball),
V100BOX_PACK_SHA256 (the engine pack's sha256, pinned because V100BOX_LAB_URL is plain HTTP),
V100BOX_TOKEN_URL and V100BOX_LAB_TOKEN (the site over HTTPS behind a bearer token) with V100BOX_LAB_CA (its
throwaway certificate, which a prepare playbook copies into the target),
V100BOX_MODEL_PATH / V100BOX_MODEL_SHA256 / V100BOX_MODEL_SIZE, V100BOX_SOURCE_SHA256, V100BOX_TEST_PORT,
V100BOX_APT_URL (the stand-in NVIDIA driver repository, `python -m lab.aptrepo build DIR`),
V100BOX_DRIVER_WINDOW (controller.model.rules.driver_window() as JSON: the roles take the window from the inventory) and
V100BOX_TARGET_IMAGE. To run one by hand, serve a site with `python -m lab.fileserver` and export
the same variables, then `cd roles/<role> && molecule test -s <scenario>`.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from controller.model import rules
from lab import aptrepo
from lab.fileserver import FileServer
from lab.site import PACK_NAME, sha256_file

pytestmark = [pytest.mark.podman, pytest.mark.engine, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = [
    ("llama_engine", "default"),
    ("llama_engine", "source"),
    ("gguf_model", "default"),
    ("llama_service", "default"),
    ("llama_service", "exposed"),
    ("llama_verify", "default"),
    ("nvidia_driver", "default"),
]
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


def _free_port_pair() -> int:
    while True:
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
        with socket.socket() as second:
            try:
                second.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


@pytest.fixture(scope="module")
def scenario_env(lab_site, target_image):
    root, catalog = lab_site
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
            "V100BOX_TARGET_IMAGE": target_image,
            "ANSIBLE_FORCE_COLOR": "0",
            "PY_COLORS": "0",
        }


@pytest.mark.parametrize(("role", "scenario"), SCENARIOS, ids=[f"{r}-{s}" for r, s in SCENARIOS])
def test_molecule_scenario(role, scenario, scenario_env):
    port = _free_port_pair()
    env = {**scenario_env, "V100BOX_TEST_PORT": str(port), "V100BOX_MOLECULE_ID": f"{role}-{scenario}-{port}"}
    done = subprocess.run(["molecule", "test", "--scenario-name", scenario], cwd=ROOT / "ansible_collections/v100box/llm/roles" / role, env=env,
                          capture_output=True, text=True, timeout=1200, check=False)
    output = done.stdout + done.stderr
    failures = [line for line in output.splitlines() if line.startswith(("fatal:", "failed:", "ERROR!", "[ERROR]"))
                or "UNREACHABLE" in line]
    assert done.returncode == 0, "\n".join(failures[:20]) + "\n...\n" + output[-4000:]
    # molecule's idempotence step reruns converge and fails on any change; make sure it ran.
    assert "idempotence" in output.lower()
