"""The built-in demo box: a systemd container on this machine, provisioned like any other box.

It uses the lab's pieces: the container (``target``), a download site with the CPU engine pack and
a generated model (``site``) served on loopback (``fileserver``), and a fleet file pointing at them.
The container is kept after the run, so the served model can be tried; ``teardown()`` removes it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import yaml

from controller.files import write_atomic
from lab import host as lab_host
from lab import image as lab_image
from lab import target as lab_target
from lab.fileserver import FileServer
from lab.site import build_site, mirror

DEMO_NAME = "v100box-demo"
DEMO_BOX = "demo"
DEMO_PORT = 18080
SITE_PORT_FILE = "site-port"  # in the demo folder: the port the demo's download site had last time
PORT_STEP = 10  # `controller demo --boxes N`: box i serves from DEMO_PORT + PORT_STEP * (i - 1) (one loopback)
MAX_BOXES = 32


def box_name(index: int) -> str:
    """The fleet's name for demo box ``index`` (1-based): demo, demo2, demo3, ..."""
    return DEMO_BOX if index == 1 else f"{DEMO_BOX}{index}"


def container_name(index: int) -> str:
    return DEMO_NAME if index == 1 else f"{DEMO_NAME}{index}"


def box_of(container: str) -> str:
    """The fleet's name for demo container ``container``: v100box-demo2 is demo2."""
    return DEMO_BOX + container.removeprefix(DEMO_NAME)


def box_index(name: str) -> int:
    """demo is 1, demo2 is 2, ...: the order of the demo boxes."""
    digits = name.removeprefix(DEMO_BOX)
    return int(digits) if digits.isdigit() else 1


def demo_dir() -> Path:
    from lab.engine_build import cache_root

    return cache_root() / "demo"


def demo_target(name: str = DEMO_NAME) -> lab_target.Target:
    """The running demo container ``name``, started if there is none."""
    lab_host.ensure_host_ready()
    image = lab_image.ensure_image()
    for record in lab_target.list_targets():
        if record.name == name:
            if record.state == "running" and record.ssh_port and record.key_path:
                running = lab_target.Target(name=record.name, ssh_port=int(record.ssh_port),
                                            key_path=Path(record.key_path), image=image)
                # A box started by an older release keeps / private, and systemd cannot hand the servers
                # their key files (credentials) there: start it anew.
                if running.run("findmnt -no PROPAGATION /").stdout.strip() == "shared":
                    return running
            lab_target.remove_containers([record.name])
    return lab_target.Target.start(name=name, image=image, owner=lab_target.MANUAL_OWNER)


def api_key_file(folder: Path, box: str = DEMO_BOX) -> Path:
    """Demo box ``box``'s own API key, made once (owner-only): `controller clients` hands it to Claude Code and
    OpenClaw. demo keeps api.key; demo2, demo3, ... have api-demo2.key, ..."""
    path = folder / ("api.key" if box == DEMO_BOX else f"api-{box}.key")
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(32) + "\n")
    return path


def write_fleet(folder: Path, target: lab_target.Target | list[lab_target.Target], server: FileServer,
                catalog: Path, base_port: int = DEMO_PORT) -> Path:
    """The demo fleet file: one box per target (demo, demo2, ...), each serving from its own ports with its own key.

    ``base_port``: the first box's (a test's demo box serves beside a running one)."""
    targets = target if isinstance(target, list) else [target]
    boxes = {
        box_name(index): {
            "address": one.host,
            "port": one.ssh_port,
            "user": one.user,
            "key": str(one.key),
            "host_key": one.host_public_key(),  # read through podman: a recreated box is no stranger
            # Claude Code and OpenClaw can use it: the planner gives it the context they need.
            "models": [{"id": "tiny-llama", "agents": ["claude-code", "openclaw"]}],
            "base_port": base_port + PORT_STEP * (index - 1),
            "api_key": {"file": str(api_key_file(folder, box_name(index)))},
            "mirror": mirror(server.url),
        }
        for index, one in enumerate(targets, start=1)
    }
    fleet: dict = {"catalogs": [str(catalog)], "boxes": boxes}
    if len(boxes) > 1:
        fleet["groups"] = {"demo-boxes": list(boxes)}
    what = "The demo box" if len(boxes) == 1 else f"The {len(boxes)} demo boxes"
    path = folder / "fleet.yml"
    write_atomic(path, f"# {what}; written by `controller demo`.\n" + yaml.safe_dump(fleet, sort_keys=False))
    return path


@contextlib.contextmanager
def demo_fleet(folder: Path | None = None, boxes: int = 1, removed: list[str] | None = None) -> Iterator[Path]:
    """Start (or reuse) ``boxes`` demo boxes and serve their downloads; yields the fleet file while serving.

    Demo boxes beyond ``boxes`` left from an earlier ``--boxes`` run are removed, their names added to ``removed``:
    the fleet file names exactly the boxes that run.
    """
    if not 1 <= boxes <= MAX_BOXES:
        raise lab_host.LabError(f"--boxes {boxes}: give 1 to {MAX_BOXES} (each box is a container on this machine)")
    folder = folder or demo_dir()
    folder.mkdir(parents=True, exist_ok=True)
    catalog = build_site(folder / "site")
    wanted = {container_name(index) for index in range(1, boxes + 1)}
    surplus = [name for name in demo_containers() if name not in wanted]
    lab_target.remove_containers(surplus)
    if removed is not None:
        removed.extend(sorted((box_of(name) for name in surplus), key=box_index))
    targets = [demo_target(container_name(index)) for index in range(1, boxes + 1)]
    with site_server(folder) as server:
        yield write_fleet(folder, targets, server, catalog)


def site_server(folder: Path) -> FileServer:
    """The demo's download site, on the port it had the last time when that port is free. The site's address is one
    of a box's inputs (its mirror), so a rerun on the same address can take the converged fast path; on a new one the
    run is a full one, and its report says the inputs differ."""
    remembered = folder / SITE_PORT_FILE
    try:
        port = int(remembered.read_text())
    except (OSError, ValueError):
        port = 0
    try:
        server = FileServer(folder / "site", port=port)
    except OSError:  # taken by something else since
        server = FileServer(folder / "site")
    write_atomic(remembered, f"{server.port}\n")
    return server


def demo_containers() -> list[str]:
    """Every demo container on this machine: v100box-demo, v100box-demo2, ..."""
    pattern = re.compile(re.escape(DEMO_NAME) + r"(\d+)?")
    return sorted(record.name for record in lab_target.list_targets() if pattern.fullmatch(record.name))


def teardown() -> list[str]:
    names = demo_containers()
    lab_target.remove_containers(names)
    return names
