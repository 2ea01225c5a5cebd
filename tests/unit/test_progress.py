"""The live progress lines print task and host names as written, whatever brackets they hold."""

from __future__ import annotations

import io

from controller.cli.progress import Progress


def test_task_names_with_square_brackets_print_as_written():
    out = io.StringIO()
    progress = Progress(stream=out)
    for task in ("Install packs [/] for [bold]every[/bold] engine", "Open port [8001] to [192.168.1.0/24]"):
        progress({"event": "runner_on_ok", "event_data": {"host": "box3", "task": task, "res": {"changed": True}}})
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("changed     Install packs [/] for [bold]every[/bold] engine")
    assert lines[1].endswith("changed     Open port [8001] to [192.168.1.0/24]")
