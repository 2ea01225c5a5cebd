"""A failed engine upgrade rolled back on a real box (SSH into a systemd container, the CPU engine, a tiny model).

The box is provisioned on the lab's CPU engine, then given a catalog whose engine for it is a new version: a real,
checksum-pinned pack whose llama-server exits at start, served from this test's own download site. The provision
installs it, switches the slot, sees the server not become healthy, switches the slot back and fails saying so;
the box serves again on the old version, and the broken version stays installed beside it. Then a version that
passes the health wait but serves another model id: the checks fail, and the slot goes back the same way."""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import pytest
import yaml

from lab.engine_build import sha256_file
from lab.fileserver import FileServer
from lab.site import LAB_ENGINE, make_pack, pinned_engine
from lab.target import free_port
from tests.cli import run_controller

pytestmark = [pytest.mark.podman, pytest.mark.engine, pytest.mark.slow]

controller = partial(run_controller, timeout=600)
SLOT = "cpu"
OLD = LAB_ENGINE.removeprefix(f"{SLOT}-")
# The planner serves a CPU box with the first CPU-only build of the catalog by id (planner/placement.py), so each
# new version's id sorts before the lab's cpu-0c1e570.
NEW = "0badbad"
WRONG = "0bad000"
SERVICE = "llama-tiny-llama"
BROKEN_LINE = "llama-server: this build is broken on purpose"
BROKEN_SERVER = f"#!/bin/sh\necho '{BROKEN_LINE}' >&2\nexit 1\n"
# The server's answers, read on the box through its own key file (the key never leaves the box).
ASK = """
import json, sys, urllib.request
port, key = sys.argv[1], open(sys.argv[2]).readline().strip()
def get(path):
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)
print(json.dumps({"health": get("/health"), "models": get("/v1/models")}))
"""


# Answers /health, serves another model id and no chat: it passes the services' health wait and fails the checks.
WRONG_SERVER = """#!/usr/bin/python3
import http.server, json, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"status": "ok"} if self.path == "/health" else {"object": "list", "data": [{"id": "not-tiny-llama"}]}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
http.server.HTTPServer(("127.0.0.1", port), Answer).serve_forever()
"""


def new_version(folder: Path, version: str, server_text: str) -> Path:
    """A catalog naming a new version of the lab's CPU engine: a real pack, sha256 pinned, whose server is given."""
    build = folder / f"build-{version}"
    build.mkdir()
    server = build / "llama-server"
    server.write_text(server_text)
    server.chmod(0o755)
    pack = make_pack(build, folder / "site" / "engines" / f"llama-{SLOT}-{version}-linux-x86_64.tar.gz")
    engine = pinned_engine(pack)[LAB_ENGINE] | {"commit": version, "description": f"the test's {version}"}
    engine["packs"] = {"linux-x86_64": {"file": pack.name, "sha256": sha256_file(pack)}}
    catalog = folder / f"upgrade-{version}.yml"
    catalog.write_text(yaml.safe_dump({"engines": {f"{SLOT}-{version}": engine}}))
    return catalog


@pytest.fixture(scope="module")
def box(tmp_path_factory, lab_site, systemd_target):
    """A box provisioned on the lab engine; yields a function that provisions it with a catalog added."""
    root, catalog = lab_site
    folder = tmp_path_factory.mktemp("rollback")
    (folder / "site" / "engines").mkdir(parents=True)
    port = free_port()
    with FileServer(root) as lab, FileServer(folder / "site") as ours:
        spec = {"address": systemd_target.host, "port": systemd_target.ssh_port, "user": "root",
                "key": str(systemd_target.key), "base_port": port, "models": [{"id": "tiny-llama", "ctx": 2048}],
                "mirror": {"engines": f"{lab.url}/engines", "models": lab.url}}
        fleet = folder / "fleet.yml"
        fleet.write_text(yaml.safe_dump({"catalogs": [str(catalog)], "boxes": {"lab1": spec}}))
        first = controller("provision", "lab1", "--fleet", str(fleet), "--json")
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        assert systemd_target.exec(f"readlink /opt/llama/{SLOT}/current").strip() == OLD

        def provision_with(version: str, server_text: str):
            upgrade = new_version(folder, version, server_text)
            moved = {**spec, "mirror": {**spec["mirror"], "engines": f"{ours.url}/engines"}}
            fleet.write_text(yaml.safe_dump({"catalogs": [str(catalog), str(upgrade)], "boxes": {"lab1": moved}}))
            started = time.monotonic()
            done = controller("provision", "lab1", "--fleet", str(fleet), "--json")
            print(f"provision onto {version}: {time.monotonic() - started:.0f} s, exit {done.returncode}: "
                  f"{done.stderr.strip()[:600]}")
            return done, port

        yield provision_with


@pytest.fixture(scope="module")
def upgrade(box):
    """The provision onto a version whose server exits at start."""
    return box(NEW, BROKEN_SERVER)


@pytest.fixture(scope="module")
def wrong_upgrade(box, upgrade):
    """After the first scenario: the provision onto a version that is healthy but serves another model id."""
    return box(WRONG, WRONG_SERVER)


def test_the_failed_upgrade_fails_the_run_naming_the_rollback(upgrade):
    done, _port = upgrade
    assert done.returncode == 5, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    message = " ".join(done.stderr.split())  # the console wraps long lines
    assert (f"{SERVICE} did not become healthy on engine {SLOT} {NEW}; rolled back to {SLOT} {OLD}, "
            f"which is serving again") in message, message


def test_the_box_serves_again_on_the_old_version(upgrade, systemd_target):
    _done, port = upgrade
    assert systemd_target.exec(f"readlink /opt/llama/{SLOT}/current").strip() == OLD
    assert systemd_target.run(f"systemctl is-active {SERVICE}.service").stdout.strip() == "active"
    answer = json.loads(systemd_target.exec(["python3", "-c", ASK, str(port), f"/etc/llama/keys/{SERVICE}.key"]))
    assert answer["health"]["status"] == "ok"
    assert [model["id"] for model in answer["models"]["data"]] == ["tiny-llama"]


def test_the_broken_version_stays_installed_and_its_log_says_why(upgrade, systemd_target):
    _done, _port = upgrade
    installed = systemd_target.exec(f"/opt/llama/{SLOT}/{NEW}/bin/llama-server 2>&1 || true")
    assert BROKEN_LINE in installed
    assert systemd_target.run(f"test -e /opt/llama/{SLOT}/previous").returncode != 0  # nothing older kept
    journal = systemd_target.exec(f"journalctl --unit {SERVICE}.service --no-pager --output cat")
    assert BROKEN_LINE in journal


def test_a_failed_check_on_the_new_version_rolls_back_too(wrong_upgrade, systemd_target):
    done, port = wrong_upgrade
    assert done.returncode == 5, done.stdout[-3000:] + done.stderr[-3000:]
    message = " ".join(done.stderr.split())
    assert (f"A check failed on engine {SLOT} {WRONG}; rolled back to {SLOT} {OLD}, which passes its checks again"
            in message), message
    assert message.count("task '") == 1, message  # the check the rescue caught is not named as a failure
    assert systemd_target.exec(f"readlink /opt/llama/{SLOT}/current").strip() == OLD
    answer = json.loads(systemd_target.exec(["python3", "-c", ASK, str(port), f"/etc/llama/keys/{SERVICE}.key"]))
    assert [model["id"] for model in answer["models"]["data"]] == ["tiny-llama"]
