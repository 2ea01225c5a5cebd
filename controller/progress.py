"""Live progress of a playbook run: a line per task result, then a summary."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from rich.console import Console
from rich.markup import escape

from controller.runner import RunResult

_STATUS = {
    "runner_on_ok": "ok",
    "runner_on_failed": "failed",
    "runner_on_skipped": "skipped",
    "runner_on_unreachable": "unreachable",
    "runner_item_on_failed": None,  # the task's own failed event follows
}
_STYLE = {"ok": "green", "changed": "yellow", "failed": "bold red", "skipped": "cyan", "unreachable": "bold red",
          "ignored": "magenta"}


def task_status(event: dict[str, Any]) -> str | None:
    """The status a person cares about for a task-result event, or None for other events."""
    status = _STATUS.get(event.get("event", ""))
    if status is None:
        return None
    data = event.get("event_data", {})
    if status == "ok" and data.get("res", {}).get("changed"):
        return "changed"
    if status == "failed" and data.get("ignore_errors"):
        return "ignored"
    return status


class Progress:
    """Event handler for ``run_playbook``: human lines on a console, or JSON lines with ``as_json``."""

    def __init__(self, *, as_json: bool = False, stream: TextIO | None = None):
        self.as_json = as_json
        self.stream = stream or sys.stdout
        self.console = Console(file=self.stream, highlight=False, soft_wrap=True)
        self.started = time.monotonic()

    def __call__(self, event: dict[str, Any]) -> None:
        status = task_status(event)
        if status is None:
            return
        data = event.get("event_data", {})
        host, task = data.get("host", "?"), data.get("task", "?")
        elapsed = time.monotonic() - self.started
        if self.as_json:
            self.stream.write(json.dumps({"type": "task", "host": host, "task": task, "status": status,
                                          "elapsed": round(elapsed, 2)}) + "\n")
            self.stream.flush()
            return
        # Host and task names are text from playbooks and inventories: never rich markup.
        self.console.print(f"{elapsed:7.1f}s  {escape(f'{host:<12}')} [{_STYLE[status]}]{status:<11}[/] "
                           f"{escape(str(task))}", markup=True)

    def summary(self, result: RunResult) -> None:
        if self.as_json:
            self.stream.write(json.dumps({"type": "summary", **summary_dict(result)}) + "\n")
            self.stream.flush()
            return
        for host, stats in sorted(result.stats.items()):
            self.console.print(
                escape(f"{result.playbook}: {host}:") + f" ok={stats.ok} changed={stats.changed} failed={stats.failures} "
                f"unreachable={stats.unreachable} skipped={stats.skipped} in {result.elapsed:.1f}s"
            )


def summary_dict(result: RunResult) -> dict[str, Any]:
    return {
        "playbook": result.playbook,
        "status": result.status,
        "elapsed": round(result.elapsed, 2),
        "hosts": {host: vars(stats) for host, stats in sorted(result.stats.items())},
    }
