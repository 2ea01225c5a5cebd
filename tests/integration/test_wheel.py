"""The wheel provisions: `pipx install .` (here: the built wheel in a fresh venv outside the clone) then
`controller provision` from another folder converges the lab's box, with nothing read from the clone.

The wheel is built from a copy of the clone's sources (the files git tracks or would track), so a build folder left
in the clone never leaks into it. The wheel's dependencies come from a wheelhouse kept in
``~/.cache/v100-llm-box/wheelhouse/<key>``, keyed by requirements.lock and pyproject.toml's dependencies, and filled
once (with the versions the lock pins) from the package index, so later runs install without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import venv
from pathlib import Path

import httpx
import pytest
import yaml

from lab.engine_build import cache_root
from lab.host import cache_lock
from lab.target import free_port

pytestmark = [pytest.mark.podman, pytest.mark.engine, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# What building the wheel reads from a clone; not ansible-test's results, which MANIFEST.in leaves out anyway.
SOURCES = ("pyproject.toml", "README.md", "MANIFEST.in", "controller", "ansible_collections")
TEST_OUTPUT = "ansible_collections/v100box/llm/tests/output/"
API_KEY = "sk-wheel-api-key-never-logged-7373"
TIMINGS: dict[str, float] = {}


def run(argv: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 900,
        ) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, (argv, done.stdout[-3000:], done.stderr[-3000:])
    return done


def source_copy(into: Path) -> Path:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *SOURCES],
                            cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if name.startswith(TEST_OUTPUT) or not source.is_file():  # or tracked, but deleted from the work tree
            continue
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, into / name)
    return into


def wheelhouse_key() -> str:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    digest = hashlib.sha256((REPO / "requirements.lock").read_bytes())
    digest.update("\n".join(project["dependencies"]).encode())
    digest.update(sys.version.encode())
    return digest.hexdigest()[:16]


def pinned_constraints(path: Path) -> Path:
    """requirements.lock as a constraints file without its hashes: the wheelhouse holds the locked versions."""
    pins = re.findall(r"^([A-Za-z0-9._-]+==[^\s;\\]+)", (REPO / "requirements.lock").read_text(), flags=re.MULTILINE)
    path.write_text("\n".join(pins) + "\n")
    return path


def wheelhouse(wheel: Path, scratch: Path) -> Path:
    """The wheel's dependencies as wheels, in a folder kept between runs (filled from the package index once)."""
    folder = cache_root() / "wheelhouse" / wheelhouse_key()
    with cache_lock(cache_root() / "wheelhouse" / ".lock"):
        if not (folder / ".complete").is_file():
            partial = folder.with_name(folder.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            constraints = pinned_constraints(scratch / "constraints.txt")
            run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(partial), "-c", str(constraints),
                 str(wheel)], cwd=scratch)
            (partial / wheel.name).unlink()  # the project's own wheel is built afresh each time
            (partial / ".complete").write_text("")
            shutil.rmtree(folder, ignore_errors=True)
            partial.rename(folder)
    return folder


def clean_env(bin_dir: Path) -> dict[str, str]:
    """What a user's shell would have: the new venv on PATH, nothing of the clone (no PYTHONPATH, no ANSIBLE_*)."""
    keep = {"HOME", "USER", "LANG", "TMPDIR", "PIP_FIND_LINKS", "PIP_CERT", "PIP_DEFAULT_TIMEOUT", "XDG_CACHE_HOME",
            "V100BOX_CACHE"}
    env = {key: value for key, value in os.environ.items() if key in keep}
    env["PATH"] = os.pathsep.join([str(bin_dir), "/usr/local/bin", "/usr/bin", "/bin"])
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv outside the clone with only the built wheel (and its dependencies) installed: its bin/."""
    scratch = tmp_path_factory.mktemp("wheel")
    started = time.monotonic()
    source = source_copy(scratch / "src")
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir",
         str(scratch / "dist"), str(source)], cwd=scratch)
    (wheel,) = (scratch / "dist").glob("v100_llm_box-*.whl")
    TIMINGS["build"] = time.monotonic() - started

    started = time.monotonic()
    house = wheelhouse(wheel, scratch)
    TIMINGS["wheelhouse"] = time.monotonic() - started
    started = time.monotonic()
    target = scratch / "venv"
    venv.create(target, with_pip=True, clear=True)
    # Without compiling every module to bytecode now (the `ansible` package is some 40 000 files): minutes less on
    # two cores; Python compiles what a run imports.
    run([str(target / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile", "--no-index",
         "--find-links", str(house), str(wheel)], cwd=scratch, env=clean_env(target / "bin"))
    TIMINGS["install"] = time.monotonic() - started
    return target / "bin"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, site_server, systemd_target) -> Path:
    """A folder outside the clone holding a fleet file for the lab's box."""
    server, catalog = site_server
    folder = tmp_path_factory.mktemp("elsewhere")
    (folder / "api_key").write_text(API_KEY)
    fleet = {
        "catalogs": [str(catalog)],
        "boxes": {"lab1": {
            "address": systemd_target.host, "port": systemd_target.ssh_port, "user": "root",
            "key": str(systemd_target.key), "models": [{"id": "tiny-llama", "ctx": 2048}], "base_port": free_port(),
            "api_key": {"file": str(folder / "api_key")},
            "mirror": {"engines": f"{server.url}/engines", "models": server.url},
        }},
    }
    (folder / "fleet.yml").write_text(yaml.safe_dump(fleet))
    return folder


def test_the_installed_wheel_provisions_the_lab_box_from_outside_the_clone(installed, workdir):
    started = time.monotonic()
    done = subprocess.run([str(installed / "controller"), "provision", "lab1", "--fleet", "fleet.yml", "--json"],
                          cwd=workdir, env=clean_env(installed), capture_output=True, text=True, timeout=900,
                          check=False)
    TIMINGS["provision"] = time.monotonic() - started
    print("wheel timings (s):", {name: round(seconds, 1) for name, seconds in TIMINGS.items()})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    report = next(line for line in lines if line.get("type") == "report")
    assert report["verified"] is True
    (service,) = report["services"]
    models = httpx.get(f"{service['endpoint']}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"},
                       timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny-llama"

    # The collection came with the wheel, into the venv's site-packages beside the controller; the lab did not.
    site_packages = next((installed.parent / "lib").glob("python3*/site-packages"))
    assert (site_packages / "ansible_collections" / "v100box" / "llm" / "galaxy.yml").is_file()
    assert not (site_packages / "lab").exists()
    # Nothing of the clone took part: each run's recorded command line and environment (ansible-runner's
    # artifacts/<id>/command) name the venv's playbook, collection and Ansible configuration.
    commands = [json.loads(path.read_text()) for path in (workdir / "inventory" / "artifacts").glob("*/command")]
    assert any(str(site_packages / "ansible_collections/v100box/llm/playbooks/site.yml") in recorded["command"]
               for recorded in commands), commands
    for recorded in commands:
        assert str(REPO) not in json.dumps(recorded), recorded
        assert recorded["env"]["ANSIBLE_CONFIG"] == str(site_packages / "controller" / "data" / "ansible.cfg")



def test_demo_from_the_wheel_says_it_needs_a_clone(installed, tmp_path):
    done = subprocess.run([str(installed / "controller"), "demo"], cwd=tmp_path, env=clean_env(installed),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "controller demo runs from a clone" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
