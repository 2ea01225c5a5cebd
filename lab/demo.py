"""The built-in demo box: a systemd container on this machine, provisioned like any other box.

It uses the lab's pieces: the container (``target``), a download site with the CPU engine pack and
a generated model (``site``) served on loopback (``fileserver``), and a fleet file pointing at them.
The container is kept after the run, so the served model can be tried; ``teardown()`` removes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import yaml

from controller.files import write_atomic
from lab import host as lab_host
from lab import image as lab_image
from lab import target as lab_target
from lab.fileserver import FileServer
from lab.site import build_site

DEMO_NAME = "v100box-demo"
DEMO_BOX = "demo"
DEMO_PORT = 18080


def demo_dir() -> Path:
    from lab.engine_build import cache_root

    return cache_root() / "demo"


def demo_target() -> lab_target.Target:
    """The running demo container, started if there is none."""
    lab_host.ensure_host_ready()
    image = lab_image.ensure_image()
    for record in lab_target.list_targets():
        if record.name == DEMO_NAME:
            if record.state == "running" and record.ssh_port and record.key_path:
                running = lab_target.Target(name=record.name, ssh_port=int(record.ssh_port),
                                            key_path=Path(record.key_path), image=image)
                # A box started by an older release keeps / private, and systemd cannot hand the servers
                # their key files (credentials) there: start it anew.
                if running.run("findmnt -no PROPAGATION /").stdout.strip() == "shared":
                    return running
            lab_target.remove_containers([record.name])
    return lab_target.Target.start(name=DEMO_NAME, image=image, owner=lab_target.MANUAL_OWNER)


def write_fleet(folder: Path, target: lab_target.Target, server: FileServer, catalog: Path) -> Path:
    fleet = {
        "catalogs": [str(catalog)],
        "boxes": {
            DEMO_BOX: {
                "address": target.host,
                "port": target.ssh_port,
                "user": target.user,
                "key": str(target.key),
                "host_key": target.host_public_key(),  # read through podman: a recreated box is no stranger
                "models": [{"id": "tiny-llama", "ctx": 2048}],
                "base_port": DEMO_PORT,
                "mirror": {"engines": f"{server.url}/engines", "models": server.url},
            }
        },
    }
    path = folder / "fleet.yml"
    write_atomic(path, "# The demo box; written by `controller demo`.\n" + yaml.safe_dump(fleet, sort_keys=False))
    return path


@contextlib.contextmanager
def demo_fleet(folder: Path | None = None) -> Iterator[Path]:
    """Start (or reuse) the demo box and serve its downloads; yields the fleet file while serving."""
    folder = folder or demo_dir()
    folder.mkdir(parents=True, exist_ok=True)
    catalog = build_site(folder / "site")
    target = demo_target()
    with FileServer(folder / "site") as server:
        yield write_fleet(folder, target, server, catalog)


def teardown() -> list[str]:
    names = [record.name for record in lab_target.list_targets() if record.name == DEMO_NAME]
    lab_target.remove_containers(names)
    return names
