"""Shared fixtures: the real CPU engine, the lab download site, and (via plugins) the systemd target."""

from __future__ import annotations

import os
import resource
import shutil
import sys
from pathlib import Path

import pytest

# The suite starts thousands of Python processes (xdist's workers, the controller, ansible-playbook, molecule, modules
# run as scripts). Where PYTHONDONTWRITEBYTECODE is set none of them keeps the bytecode it compiles, nor pytest its
# rewritten test modules, and each compiles again (collecting the suite: 4.7 s of CPU against 2.0). The suite's
# processes write it; scripts/bootstrap.sh has already compiled the installed packages and the project's code.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

pytest_plugins = ["tests.plugins.target", "tests.plugins.schedule"]

SHARED_FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "real"
IN_CI = os.environ.get("CI") == "true"
# The gateway's tests hold more client connections than the gateway's maxconn (over a thousand sockets in this
# process), beside what the suite keeps open: a soft limit of 1024 descriptors, as a service or a container may start
# with, is too few. The soft limit may be raised up to the hard one. (Importing ansible_test lowers it to 1024: the
# suite asks ansible_test in child processes only: tests/unit/test_descriptor_limit.py.)
NEEDED_DESCRIPTORS = 4096


def wanted_descriptors() -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return NEEDED_DESCRIPTORS if hard == resource.RLIM_INFINITY else min(hard, NEEDED_DESCRIPTORS)


def pytest_configure(config):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = wanted_descriptors()
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


@pytest.fixture(scope="session")
def engine_dir() -> Path:
    """The cached CPU llama-server build (built on first use: minutes on two cores)."""
    from lab.engine_build import build

    if shutil.which("cmake") is None:
        pytest.fail("cmake is not installed; run ./scripts/bootstrap.sh")
    return build()


@pytest.fixture(scope="session")
def llama_server(engine_dir: Path) -> Path:
    return engine_dir / "llama-server"


@pytest.fixture(scope="session")
def lab_site(tmp_path_factory, engine_dir) -> tuple[Path, Path]:
    """A download site with the engine pack and the demo model; returns (root, catalog file)."""
    from lab.site import build_site

    root = tmp_path_factory.mktemp("site")
    return root, build_site(root)


@pytest.fixture(scope="module")
def site_server(lab_site):
    """The lab download site served over HTTP for one test module: (server, catalog file)."""
    from lab.fileserver import FileServer

    root, catalog = lab_site
    with FileServer(root) as server:
        yield server, catalog


@pytest.fixture(scope="session")
def real_fixtures() -> Path:
    """Public nvidia-smi and llama.cpp outputs kept beside the project (../shared/fixtures/real)."""
    if not SHARED_FIXTURES.is_dir():
        if IN_CI:
            pytest.fail(f"{SHARED_FIXTURES} is missing; CI runs with shared/ beside the clone")
        pytest.skip("../shared/fixtures/real is not beside this clone")
    return SHARED_FIXTURES
