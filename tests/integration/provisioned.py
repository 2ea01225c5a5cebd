"""A fleet of two boxes for the commands that read a provisioned box: lab1, provisioned once on the systemd target,
and lab2, the same box behind an SSH port nothing listens on (down, or never provisioned)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from lab.fileserver import FileServer
from lab.site import mirror
from lab.target import Target, free_port
from tests.cli import run_controller


@contextmanager
def provisioned_fleet(folder: Path, lab_site: tuple[Path, Path], target: Target, box: Mapping[str, Any], *,
                      timeout: float) -> Iterator[Path]:
    """Write ``folder/fleet.yml`` (lab1 and lab2 with the settings ``box``, each on its own free ports) and run
    ``controller provision lab1`` from the lab site; yields the fleet file while the site is still served."""
    root, catalog = lab_site
    with FileServer(root) as server:
        settings = {**target.fleet_entry(), "mirror": mirror(server.url), **box}
        fleet = {"catalogs": [str(catalog)], "boxes": {
            "lab1": {**settings, "base_port": free_port()},
            "lab2": {**settings, "port": free_port(), "base_port": free_port()},
        }}
        path = folder / "fleet.yml"
        path.write_text(yaml.safe_dump(fleet))
        done = run_controller("provision", "lab1", "--fleet", str(path), "--json", timeout=timeout)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        yield path
