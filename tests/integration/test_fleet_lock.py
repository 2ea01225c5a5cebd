"""The fleet lock end to end: two systemd targets provisioned from one lock end up identical, and `--locked`
refuses a changed checksum before anything runs on a box.

The targets share the host's network, so the two boxes differ in their SSH and server ports, and only there:
everything compared is the same once the box's own port is written as PORT.
"""

from __future__ import annotations

import json
import shutil
from functools import partial

import pytest
import yaml

from lab.target import free_port
from tests.cli import run_controller

pytestmark = [pytest.mark.podman, pytest.mark.engine, pytest.mark.slow]

API_KEY = "sk-lock-api-key-never-logged-4242"
BOXES = ("lab1", "lab2")
# What the roles install: engine versions, model files, chat templates and config, the units.
INSTALLED = "/opt/llama /var/lib/llama/models /etc/llama /etc/systemd/system"
controller = partial(run_controller, timeout=600)


@pytest.fixture(scope="module")
def targets(target_image):
    from lab.target import started

    with started(target_image, BOXES) as boxes:
        yield boxes


@pytest.fixture(scope="module")
def fleet_file(tmp_path_factory, site_server, targets):
    server, catalog = site_server
    folder = tmp_path_factory.mktemp("fleet")
    shutil.copy(catalog, folder / "catalog.yml")  # the test changes its own copy, never the shared site's
    (folder / "api_key").write_text(API_KEY)
    boxes = {name: {"address": target.host, "port": target.ssh_port, "user": "root", "key": str(target.key),
                    "models": [{"id": "tiny-llama", "ctx": 2048}], "base_port": free_port(),
                    "api_key": {"file": str(folder / "api_key")},
                    "mirror": {"engines": f"{server.url}/engines", "models": server.url}}
             for name, target in targets.items()}
    path = folder / "fleet.yml"
    path.write_text(yaml.safe_dump({"catalogs": ["catalog.yml"], "boxes": boxes}))
    return path


def installed(target, port: int) -> dict[str, str]:
    """Every file the roles installed on the box, path -> sha256, with the box's own port written as PORT."""
    listing = target.exec(f"find {INSTALLED} -type f -path '*llama*' -print0 | sort -z | xargs -0 sha256sum")
    files = {}
    for line in listing.splitlines():
        digest, path = line.split(maxsplit=1)
        if path.endswith(".service") or path.endswith(".env"):  # the unit names the box's port: compare its text
            digest = target.exec(f"cat {path}").replace(str(port), "PORT")
        elif path.endswith(".verified"):  # the download marker records this box's inode and mtime: present is enough
            digest = "marker"
        files[path] = digest
    return files


def without_port(data, port: int):
    """``data`` with the box's own port (a number, or inside a string) written as PORT."""
    if isinstance(data, dict):
        return {key: without_port(value, port) for key, value in data.items()}
    if isinstance(data, list):
        return [without_port(value, port) for value in data]
    if data == port:
        return "PORT"
    return data.replace(str(port), "PORT") if isinstance(data, str) else data


def test_two_boxes_from_one_lock_are_identical(fleet_file, targets):
    fleet = yaml.safe_load(fleet_file.read_text())
    ports = {name: fleet["boxes"][name]["base_port"] for name in BOXES}

    written = controller("lock", "--fleet", str(fleet_file))
    assert written.returncode == 0, written.stdout + written.stderr
    lock_file = fleet_file.with_name("fleet.lock.yml")
    lock = yaml.safe_load(lock_file.read_text())
    assert sorted(lock["boxes"]) == list(BOXES) and lock["fleet"]["file"] == "fleet.yml"
    entry = lock["boxes"]["lab1"]
    assert entry["models"]["tiny-llama-128k-q8_0.gguf"]["sha256"] and entry["engines"]["cpu-0c1e570"]["sha256"]

    text = lock_file.read_text()
    done = controller("provision", *BOXES, "--fleet", str(fleet_file), "--locked", "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert lock_file.read_text() == text  # a locked run installs the lock, never rewrites it

    inventory = fleet_file.parent / "inventory"
    plans = {name: json.loads((inventory / "plans" / f"{name}.json").read_text()) for name in BOXES}
    assert without_port(plans["lab1"], ports["lab1"]) == without_port(plans["lab2"], ports["lab2"])
    assert (without_port(lock["boxes"]["lab1"], ports["lab1"])
            == without_port(lock["boxes"]["lab2"], ports["lab2"]))

    files = {name: installed(targets[name], ports[name]) for name in BOXES}
    assert any(path.startswith("/var/lib/llama/models/") for path in files["lab1"])
    assert any(path.startswith("/opt/llama/") for path in files["lab1"])
    assert any(path.endswith(".service") for path in files["lab1"])
    assert files["lab1"] == files["lab2"]
    model = files["lab1"]["/var/lib/llama/models/tiny-llama-128k-q8_0.gguf"]
    assert model == lock["boxes"]["lab1"]["models"]["tiny-llama-128k-q8_0.gguf"]["sha256"]

    again = controller("lock", "--fleet", str(fleet_file))  # the lock still matches what the boxes plan to
    assert again.returncode == 0 and "up to date" in again.stdout

    # Provisioning without --locked writes what it installed into the lock: converged boxes change nothing.
    rerun = controller("provision", "--all", "--fleet", str(fleet_file), "--json")
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    lines = [json.loads(line) for line in rerun.stdout.splitlines() if line.startswith("{")]
    assert {"type": "lock", "lock": str(lock_file), "changes": []} in lines
    assert lock_file.read_text() == text


def test_locked_refuses_a_changed_checksum_before_touching_the_box(fleet_file, targets):
    catalog_file = fleet_file.parent / "catalog.yml"
    catalog = yaml.safe_load(catalog_file.read_text())
    catalog["models"]["tiny-llama"]["sha256"] = "0" * 64
    catalog_file.write_text(yaml.safe_dump(catalog))
    inventory = fleet_file.parent / "inventory"
    port = yaml.safe_load(fleet_file.read_text())["boxes"]["lab2"]["base_port"]
    before = installed(targets["lab2"], port)
    runs_before = sorted((inventory / "artifacts").iterdir())
    host_vars = (inventory / "host_vars" / "lab2.yml").read_text()

    refused = controller("provision", "lab2", "--fleet", str(fleet_file), "--locked")
    assert refused.returncode == 7, refused.stdout + refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert "box lab2: model file tiny-llama-128k-q8_0.gguf: sha256 is now 000000000000…" in refused.stderr

    assert sorted((inventory / "artifacts").iterdir()) == runs_before  # no ansible run started
    assert (inventory / "host_vars" / "lab2.yml").read_text() == host_vars  # nothing re-rendered
    assert installed(targets["lab2"], port) == before  # the box untouched
