"""Live progress of a playbook run: a line per task result, then a summary."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console
from rich.markup import escape

from controller.stages.runner import RunResult

if TYPE_CHECKING:
    from controller.stages.strategy import Choice

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
    """Event handler for ``run_playbook``: human lines on a console, or JSON lines with ``as_json``.

    Compact by default: a line for each task that changed something or failed, a line per role (or the play's own
    tasks) with its counts when it ends, and on a terminal a bar of tasks done of those expected (the previous
    run's count of the same playbook, ``expected``) with the time elapsed (rich's progress display). ``verbose``:
    a line per task result, as the run's artifacts also keep them. JSON lines are one per task either way.
    """

    def __init__(self, *, as_json: bool = False, stream: TextIO | None = None, verbose: bool = False,
                 expected: int | None = None):
        self.as_json = as_json
        self.verbose = verbose
        self.stream = stream or sys.stdout
        self.console = Console(file=self.stream, highlight=False, soft_wrap=True)
        self.started = time.monotonic()
        self.done = 0  # task results seen
        self.converged = False  # a box of the run took playbooks/site.yml's converged fast path
        self.section: str | None = None
        self.counts: dict[str, int] = {}
        self.section_started = self.started
        self.bar: Any = None
        self.bar_task: Any = None
        if not as_json and not verbose and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            self.bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           console=self.console, transient=True)
            self.bar_task = self.bar.add_task("tasks", total=expected)
            self.bar.start()

    def __call__(self, event: dict[str, Any]) -> None:
        if event.get("event") == "playbook_on_stats":
            self.close()
            return
        status = task_status(event)
        if status is None:
            return
        data = event.get("event_data", {})
        host, task = data.get("host", "?"), data.get("task", "?")
        elapsed = time.monotonic() - self.started
        self.done += 1
        said = _converged_line(data)
        self.converged |= bool((data.get("res") or {}).get("converged")) and said is not None
        if self.as_json:
            self.stream.write(json.dumps({"type": "task", "host": host, "task": task, "status": status,
                                          "elapsed": round(elapsed, 2)}) + "\n")
            if said:  # the converged fast path's decision for this box
                self.stream.write(json.dumps(_fast_path_event(host, data)) + "\n")
            self.stream.flush()
            return
        section = data.get("role") or "play"
        if section != self.section:
            self._end_section()
            self.section, self.counts, self.section_started = section, {}, time.monotonic()
        self.counts[status] = self.counts.get(status, 0) + 1
        if self.bar is not None:
            self.bar.update(self.bar_task, completed=self.done, description=escape(section))
        if self.verbose or status not in ("ok", "skipped"):
            self._line(elapsed, host, status, str(task))
        if said:
            self.console.print(f"{elapsed:7.1f}s  " + escape(f"{host}: {said}"))

    def _line(self, elapsed: float, host: str, status: str, task: str) -> None:
        # Host and task names are text from playbooks and inventories: never rich markup.
        self.console.print(f"{elapsed:7.1f}s  {escape(f'{host:<12}')} [{_STYLE[status]}]{status:<11}[/] "
                           f"{escape(task)}", markup=True)

    def _end_section(self) -> None:
        if self.section is None or not self.counts:
            return
        counts = " ".join(f"{status}={self.counts[status]}" for status in _STYLE if status in self.counts)
        elapsed = time.monotonic() - self.started
        self.console.print(f"{elapsed:7.1f}s  " + escape(f"{self.section:<24} {counts}")
                           + f" [dim]({time.monotonic() - self.section_started:.1f}s)[/]", markup=True)
        self.section, self.counts = None, {}

    def close(self) -> None:
        """The last section's line; the bar goes away."""
        if self.as_json:
            return
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        self._end_section()

    def summary(self, result: RunResult, strategy: Choice | None = None) -> None:
        """Each host's counts, and the Ansible strategy of a provision and why (``strategy``)."""
        self.close()
        if self.as_json:
            extra = {"strategy": strategy.as_dict()} if strategy is not None else {}
            self.stream.write(json.dumps({"type": "summary", **summary_dict(result), **extra}) + "\n")
            self.stream.flush()
            return
        for host, stats in sorted(result.stats.items()):
            self.console.print(
                escape(f"{result.playbook}: {host}:") + f" ok={stats.ok} changed={stats.changed} failed={stats.failures} "
                f"unreachable={stats.unreachable} skipped={stats.skipped} in {result.elapsed:.1f}s"
            )
        if strategy is not None:
            self.console.print(strategy_line(strategy))


def strategy_line(choice: Choice) -> str:
    """The summaries' line naming the Ansible strategy of a provision and why (rich markup escaped)."""
    return escape(f"Ansible strategy {choice.strategy}: {choice.reason}")


def _fast_path_event(host: str, data: dict[str, Any]) -> dict[str, Any]:
    """The ``fast_path`` JSON event of a comparison's result (``_converged_line`` said it is one)."""
    res = data.get("res") or {}
    return {"type": "fast_path", "host": host, "converged": bool(res["converged"]),
            "reasons": list(res.get("reasons") or []), "entries": res.get("entries", 0)}


def _converged_line(data: dict[str, Any]) -> str | None:
    """What playbooks/site.yml's comparison with the box's record decided, in words (None for other tasks)."""
    res = data.get("res") or {}
    if "converged" not in res or "reasons" not in res or data.get("task_action", "").rsplit(".", 1)[-1] not in (
            "box_manifest", ""):
        return None
    if res.get("converged"):
        return (f"converged: matches the record of its last full run ({res.get('entries', 0)} things); "
                "only the servers are checked")
    reasons = res.get("reasons") or []
    return f"full run: {'; '.join(reasons)}" if reasons else None


def summary_dict(result: RunResult) -> dict[str, Any]:
    return {
        "playbook": result.playbook,
        "status": result.status,
        "elapsed": round(result.elapsed, 2),
        "hosts": {host: vars(stats) for host, stats in sorted(result.stats.items())},
    }


class FleetProgress:
    """Event and stage handler for a run over several boxes: a live line per box, then the summary table.

    On a terminal the lines are one table redrawn in place (box, its current task, ok/changed/failed so far);
    elsewhere each task result is a line naming its box with the box's counts. ``as_json``: JSON lines
    (``task`` and ``stage`` events), then one ``fleet`` object, the summary.
    """

    def __init__(self, boxes: list[str], *, as_json: bool = False, stream: TextIO | None = None):
        self.as_json = as_json
        self.stream = stream or sys.stdout
        # Not a terminal (a log, a pipe): wide enough that the summary's reasons stay on their lines.
        tty = self.stream.isatty()
        self.console = Console(file=self.stream, highlight=False, width=None if tty else 200, soft_wrap=not tty)
        self.started = time.monotonic()
        self.rows: dict[str, dict[str, Any]] = {box: {"task": "waiting", "ok": 0, "changed": 0, "failed": 0}
                                                for box in boxes}
        self.live: Any = None

    def __enter__(self) -> FleetProgress:
        if not self.as_json and self.console.is_terminal:
            from rich.live import Live

            self.live = Live(self._table(), console=self.console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.update(self._table())
            self.live.__exit__(None, None, None)
            self.live = None

    def _table(self) -> Any:
        from rich.table import Table

        table = Table(box=None, pad_edge=False)
        for column in ("box", "task", "ok", "changed", "failed"):
            table.add_column(column, justify="right" if column in ("ok", "changed", "failed") else "left")
        for box, row in self.rows.items():
            table.add_row(escape(box), escape(str(row["task"])), str(row["ok"]), str(row["changed"]),
                          str(row["failed"]))
        return table

    def _emit(self, record: dict[str, Any], line: str) -> None:
        if self.as_json:
            self.stream.write(json.dumps(record) + "\n")
            self.stream.flush()
        elif self.live is not None:
            self.live.update(self._table())
        else:
            self.console.print(line, markup=True)

    def stage(self, box: str, stage: str, detail: str) -> None:
        """Probe, plan and render news of one box (before the run)."""
        row = self.rows.setdefault(box, {"task": "", "ok": 0, "changed": 0, "failed": 0})
        row["task"] = f"{stage}: {detail}" if detail else stage
        elapsed = time.monotonic() - self.started
        self._emit({"type": "stage", "box": box, "stage": stage, "detail": detail, "elapsed": round(elapsed, 2)},
                   f"{elapsed:7.1f}s  {escape(f'{box:<12}')} {escape(f'{stage:<11}')} {escape(detail)}")

    def __call__(self, event: dict[str, Any]) -> None:
        data = event.get("event_data", {})
        host = data.get("host")
        if event.get("event") == "runner_on_start" and host in self.rows:
            self.rows[host]["task"] = data.get("task", "?")
            if self.live is not None:
                self.live.update(self._table())
            return
        status = task_status(event)
        if status is None or host is None:
            return
        said = _converged_line(data)
        if said:  # the converged fast path's decision for this box
            elapsed = time.monotonic() - self.started
            self._emit(_fast_path_event(host, data), f"{elapsed:7.1f}s  " + escape(f"{host}: {said}"))
        row = self.rows.setdefault(host, {"task": "", "ok": 0, "changed": 0, "failed": 0})
        task = data.get("task", "?")
        row["task"] = task
        if status in ("ok", "changed"):
            row["ok"] += 1
            row["changed"] += status == "changed"
        elif status in ("failed", "unreachable"):
            row["failed"] += 1
        elapsed = time.monotonic() - self.started
        counts = f"ok={row['ok']} changed={row['changed']} failed={row['failed']}"
        self._emit({"type": "task", "host": host, "task": task, "status": status, "elapsed": round(elapsed, 2)},
                   f"{elapsed:7.1f}s  {escape(f'{host:<12}')} [{_STYLE[status]}]{status:<11}[/] "
                   f"{escape(str(task))}  [dim]({counts})[/]")

    def summary(self, fleet_run: Any) -> None:
        """The table at the end (box, result, changed, time, verified, why), or the ``fleet`` JSON object."""
        if self.as_json:
            self.stream.write(json.dumps({"type": "fleet", **fleet_run.as_dict()}) + "\n")
            self.stream.flush()
            return
        self.console.print(summary_table(fleet_run))
        failed = len(fleet_run.failed)
        self.console.print(f"{len(fleet_run.outcomes) - failed} of {len(fleet_run.outcomes)} boxes provisioned and "
                           f"verified in {fleet_run.elapsed:.1f}s (probe and plan {fleet_run.prepare_seconds:.1f}s, "
                           f"{fleet_run.forks} forks)")
        if fleet_run.strategy is not None:
            self.console.print(strategy_line(fleet_run.strategy))


def summary_table(fleet_run: Any) -> Any:
    """The summary of a fleet run as a rich Table: one row per box, in the order they were named."""
    from rich.table import Table

    table = Table(title="fleet summary", title_justify="left", box=None, pad_edge=False)
    for column in ("box", "result", "changed", "time", "verified", "why"):
        table.add_column(column, justify="right" if column in ("changed", "time") else "left",
                         overflow="fold")
    for outcome in fleet_run.outcomes:
        style = "green" if outcome.result == "ok" else "bold red"
        table.add_row(escape(outcome.box), f"[{style}]{escape(outcome.result)}[/]", str(outcome.changed),
                      f"{outcome.seconds:.1f}s", "yes" if outcome.verified else "no", escape(outcome.reason or ""))
    return table
