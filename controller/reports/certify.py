"""The certification report handed to a box's buyer: Markdown, one self-contained HTML page, plots, a PDF.

The report dict (built by the certify stage, shape in its JSON) is turned into sections once
(``sections``); the Markdown and the HTML page both walk those sections, so every part of the report
appears in both. Everything here is pure except ``write_reports`` and ``write_buyer_copy``, which write
the files, and ``print_pdf``, which runs a headless Chromium.
"""

from __future__ import annotations

import io
import json
import math
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from controller.files import write_atomic
from controller.inventory import Inventory

PDF_TIMEOUT_S = 90
EVENTS_SHOWN = 200  # thermal guard events listed in the page; the JSON report keeps them all
WINDOW_REQUESTS = 5  # the burn-in's generation speed is shown as the median of each run of this many requests
BROWSERS = ("chromium", "chromium-browser")
DASH = "—"
_SVG_MUTEX = threading.Lock()  # rc_context changes matplotlib's process-wide settings while a plot is saved
TITLES = {"identity": "Identity", "installed": "Installed", "endpoints": "Endpoints", "throughput": "Throughput",
          "burn_in": "Burn-in", "burn-in": "Burn-in", "thermal": "Thermal guard", "thermal_guard": "Thermal guard",
          "power": "Power limits", "seal": "Seal", "gpu_memory": "GPU memory vs plan"}


@dataclass(frozen=True)
class Table:
    columns: list[str]
    rows: list[list[str]]
    mono: frozenset[int] = frozenset()  # columns of identifiers, hashes and paths


@dataclass(frozen=True)
class Facts:
    rows: list[tuple[str, str]]


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Items:
    items: list[str]


@dataclass(frozen=True)
class Heading:
    text: str


@dataclass(frozen=True)
class Pre:
    text: str


@dataclass(frozen=True)
class Plot:
    name: str
    title: str


@dataclass
class Section:
    key: str
    title: str
    status: str | None = None  # "pass", "fail", "not checked" or None (nothing to judge)
    blocks: list[Any] = field(default_factory=list)


# ---------------------------------------------------------------- values


def _fmt(value: Any) -> str:
    """A value as a person reads it: a dash for nothing, yes/no, lists joined, small dicts inline."""
    if value is None or value == "" or value == [] or value == {}:
        return DASH
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}" if not value.is_integer() else str(int(value))
    if isinstance(value, list | tuple):
        return ", ".join(_fmt(item) for item in value)
    if isinstance(value, dict):  # read, not parsed: "key value; key value"
        return "; ".join(f"{_name(key)} {_fmt(item)}" for key, item in value.items()) or DASH
    return str(value)


def _verdict(passed: Any) -> str:
    return "PASS" if passed is True else "FAIL" if passed is False else "not judged"


def _range(pair: Any, unit: str) -> str:
    if not isinstance(pair, list | tuple) or len(pair) != 2 or pair == [None, None]:
        return DASH
    low, high = pair
    if high is None:
        return f"≥ {_fmt(low)} {unit}"
    if low is None:
        return f"≤ {_fmt(high)} {unit}"
    return f"{_fmt(low)}–{_fmt(high)} {unit}"


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _dict_table(rows: list[dict[str, Any]], known: list[tuple[str, str]], mono: tuple[str, ...] = ()) -> Table:
    """A table of dicts: the known keys under their labels, then any other key the rows carry, by its name."""
    extra = [key for row in rows for key in row if key not in dict(known)]
    keys = [(key, label) for key, label in known if any(key in row for row in rows)]
    keys += [(key, _name(key)) for key in dict.fromkeys(extra)]
    mono = (*mono, *(key for key in dict.fromkeys(extra) if _identifiers(row.get(key) for row in rows)))
    return Table([label for _, label in keys], [[_fmt(row.get(key)) for key, _ in keys] for row in rows],
                 frozenset(i for i, (key, _) in enumerate(keys) if key in mono))


def _identifiers(values: Any) -> bool:
    """Whether a column nobody labelled holds hashes, paths or file names (set in monospace, wrapped anywhere)."""
    texts = [value for value in values if isinstance(value, str) and value]
    return bool(texts) and all(" " not in text and (_HEXISH.fullmatch(text) or "/" in text or "." in text)
                               for text in texts)


_HEXISH = re.compile(r"(?:sha256:)?[0-9a-fA-F]{16,}")


def _name(key: Any) -> str:
    """A field's name as a heading: ``compute_capability`` -> ``compute capability``."""
    return str(key).replace("_", " ")


def _why_missing(report: dict[str, Any], key: str, title: str) -> str:
    """Why a section has no data: the report's own not_checked entry for it, or a plain sentence."""
    for item in _dicts(report.get("not_checked")):
        if item.get("section") == key or str(item.get("name", "")).lower() in (key, key.replace("_", "-"),
                                                                                 title.lower()):
            return str(item.get("why") or "no reason given")
    return f"the report holds no {title.lower()} data"


def _status(report: dict[str, Any], *sections: str) -> str | None:
    checks = [check for check in _dicts(report.get("checks")) if check.get("section") in sections]
    if not checks:
        return None
    return "pass" if all(check.get("passed") is True for check in checks) else "fail"


# ---------------------------------------------------------------- sections


def sections(report: dict[str, Any]) -> list[Section]:
    """The report as the sections both renderings show, in order; absent parts say why."""
    return [_summary(report), _not_checked(report), _identity(report), _installed(report), _endpoints(report),
            _throughput(report), _gpu_memory(report), _burn_in(report), _thermal(report), _power(report), _seal(report)]


def _missing(report: dict[str, Any], key: str, title: str) -> Section:
    return Section(key, title, "not checked", [Text(f"not checked: {_why_missing(report, key, title)}")])


def _summary(report: dict[str, Any]) -> Section:
    checks = _dicts(report.get("checks"))
    failed = [check for check in checks if check.get("passed") is not True]
    overall = report.get("passed")
    run = report.get("run") if isinstance(report.get("run"), dict) else {}
    blocks: list[Any] = [
        Text(f"Box {_fmt(report.get('box'))} at {_fmt(report.get('address'))}: certification "
             + ("PASSED" if overall is True else "FAILED")
             + (f" ({len(failed)} of {len(checks)} checks failed)." if failed else f" ({len(checks)} checks).")),
        Facts([("Generated", _fmt(report.get("generated"))), ("Certify version", _fmt(report.get("certify_version"))),
               *([("Burn-in asked for", f"{_fmt(report['burn_in_s'])} s")] if report.get("burn_in_s") else []),
               *([("Checks ran", f"{_fmt(run.get('playbook'))}: {_fmt(run.get('status'))} in "
                  f"{_fmt(run.get('elapsed'))} s")] if run else [])]),
    ]
    failures = [str(item) for item in run.get("failed") or []]
    if failures:
        blocks += [Text("Tasks that failed while checking:"), Items(failures)]
    if checks:
        blocks.append(Table(["Check", "Section", "Result", "Detail"],
                            [[_fmt(check.get("name")), TITLES.get(str(check.get("section")), _fmt(check.get("section"))),
                              _verdict(check.get("passed")),
                              _fmt(check.get("detail"))] for check in checks]))
    else:
        blocks.append(Text("No check ran."))
    return Section("summary", "Summary", "pass" if overall is True else "fail", blocks)


def _not_checked(report: dict[str, Any]) -> Section:
    items = _dicts(report.get("not_checked"))
    if not items:
        return Section("not_checked", "Not checked", None, [Text("Nothing was left unchecked.")])
    return Section("not_checked", "Not checked", None, [
        Text("These were not checked, and why:"),
        Table(["What", "Why"], [[_fmt(item.get("name")), _fmt(item.get("why"))] for item in items])])


def _identity(report: dict[str, Any]) -> Section:
    identity = report.get("identity")
    if not isinstance(identity, dict):
        return _missing(report, "identity", "Identity")
    blocks: list[Any] = [Heading("GPUs")]
    gpus = _dicts(identity.get("gpus"))
    blocks.append(_dict_table(gpus, [("index", "GPU"), ("name", "Name"), ("uuid", "UUID"), ("serial", "Serial"),
                                     ("memory_mib", "VRAM (MiB)"), ("compute_capability", "Compute capability"),
                                     ("pci_bus_id", "PCI bus"), ("power_limit_w", "Power limit (W)"),
                                     ("temperature_c", "Temperature (°C)")], mono=("uuid", "serial", "pci_bus_id"))
                  if gpus else Text("No NVIDIA GPU was seen."))
    driver = identity.get("driver") if isinstance(identity.get("driver"), dict) else {}
    cpu = identity.get("cpu") if isinstance(identity.get("cpu"), dict) else {}
    nvlink = _dicts(identity.get("nvlink"))
    blocks.append(Facts([
        ("Driver", _fmt(driver.get("version"))),
        ("CUDA", _fmt(driver.get("cuda_version"))),
        ("Driver mode", _fmt(driver.get("model"))),
        ("NVLink", "; ".join(f"GPUs {_fmt(link.get('gpus'))}: {_fmt(link.get('links'))} links" for link in nvlink)
         or "none seen"),
        ("CPU", f"{_fmt(cpu.get('model'))} ({_fmt(cpu.get('cores'))} cores, {_fmt(cpu.get('threads'))} threads)"),
        ("Memory", f"{_fmt(identity.get('memory_mib'))} MiB"),
        ("OS", _fmt(identity.get("os"))),
    ]))
    disks = _dicts(identity.get("disks"))
    blocks.append(Heading("Disks"))
    blocks.append(_dict_table(disks, [("name", "Disk"), ("path", "Path"), ("model", "Model"),
                                      ("filesystem", "Filesystem"), ("size_bytes", "Size (bytes)"),
                                      ("total_mib", "Size (MiB)"), ("free_mib", "Free (MiB)")], mono=("name", "path"))
                  if disks else Text("No disk was listed."))
    warnings = [str(warning) for warning in identity.get("warnings") or []]
    if warnings:
        blocks += [Heading("Probe warnings"), Items(warnings)]
    return Section("identity", "Identity", _status(report, "identity"), blocks)


def _installed(report: dict[str, Any]) -> Section:
    installed = report.get("installed")
    if not isinstance(installed, dict):
        return _missing(report, "installed", "Installed")
    blocks: list[Any] = []
    parts = [
        ("Engines", "engines", [("id", "Engine"), ("slot", "Slot"), ("commit", "Commit"), ("version", "Version"),
                                ("previous", "Previous"), ("sha256", "Pack sha256"), ("planned", "Planned"),
                                ("running", "Running"), ("locked", "Locked")],
         ("id", "commit", "version", "previous", "sha256", "planned", "running", "locked")),
        ("Model files", "models", [("file", "File"), ("path", "Path"), ("sha256", "sha256"),
                                   ("size_bytes", "Size (bytes)"), ("recorded_sha256", "Install record"),
                                   ("locked_sha256", "Lock"), ("ok", "Checksum ok")],
         ("file", "path", "sha256", "recorded_sha256", "locked_sha256")),
        ("Chat templates", "templates", [("name", "Template"), ("sha256", "sha256")], ("name", "sha256")),
        ("Service units", "units", [("name", "Unit"), ("state", "State"), ("enabled", "Enabled"),
                                    ("active", "Active")], ("name",)),
    ]
    for title, key, known, mono in parts:
        rows = [_same_hash(row) for row in _dicts(installed.get(key))]
        blocks += [Heading(title), _dict_table(rows, known, mono) if rows else Text(f"No {title.lower()} listed.")]
    plan = installed.get("plan") if isinstance(installed.get("plan"), dict) else {}
    services = _dicts(plan.get("services"))
    blocks.append(Heading("Plan"))
    if not services:
        blocks.append(Text("No planned service listed."))
    for service in services:
        blocks.append(Facts([
            ("Service", _fmt(service.get("name"))), ("Model", _fmt(service.get("model"))),
            ("Engine", _fmt(service.get("engine"))), ("GPUs", _fmt(service.get("gpus")) if service.get("gpus")
                                                       else "none (CPU)"),
            ("Context", _fmt(service.get("ctx"))), ("Parallel slots", _fmt(service.get("parallel"))),
            *((_name(key), _fmt(value)) for key, value in service.items()
              if key not in {"name", "model", "engine", "gpus", "ctx", "parallel", "reasons"})]))
        reasons = [str(reason) for reason in service.get("reasons") or []]
        blocks += [Text("Why:"), Items(reasons)] if reasons else [Text("No reason recorded.")]
    blocks.append(Heading("Lock"))
    lock = installed.get("lock")
    blocks += _lock_blocks(lock) if isinstance(lock, dict) and lock else [Text("No fleet lock names this box.")]
    return Section("installed", "Installed", _status(report, "installed"), blocks)


def _same_hash(row: dict[str, Any]) -> dict[str, Any]:
    """A model file's install record and lock checksums read "matches" where they are its sha256: each hash once."""
    return {key: "matches" if key in ("recorded_sha256", "locked_sha256") and value and value == row.get("sha256")
            else value for key, value in row.items()}


# The lock entry's tables (controller.actions.lock.BoxLock): its key, the key's column, the known columns, monospace ones.
LOCK_TABLES = [
    ("engines", "Locked engines", "Engine", [("slot", "Slot"), ("commit", "Commit"), ("platform", "Platform"),
                                             ("file", "Pack"), ("sha256", "Pack sha256")],
     ("commit", "file", "sha256")),
    ("models", "Locked model files", "File", [("id", "Model"), ("sha256", "sha256"), ("size_bytes", "Size (bytes)")],
     ("sha256",)),
    ("templates", "Locked chat templates", "Template", [("sha256", "sha256")], ("sha256",)),
    ("services", "Locked services", "Service", [("model", "Model"), ("engine", "Engine"), ("host", "Host"),
                                                ("port", "Port"), ("template", "Template"), ("args", "Arguments"),
                                                ("env", "Environment")], ("engine", "args", "env")),
]
_KEY = ""  # the column of the rows' names (no field of a lock entry is named "")


def _lock_blocks(lock: dict[str, Any]) -> list[Any]:
    """The box's lock entry as a person reads it: a table per kind of thing locked, the rest as facts."""
    blocks: list[Any] = []
    facts = []
    tables = {key: (title, column, known, mono) for key, title, column, known, mono in LOCK_TABLES}
    for key, value in lock.items():
        entries = value if isinstance(value, dict) else {}
        if key in tables and entries and all(isinstance(item, dict) for item in entries.values()):
            title, column, known, mono = tables[key]
            rows = [{_KEY: name, **{field: _spelled(field, item) for field, item in fields.items()}}
                    for name, fields in entries.items()]
            blocks += [Heading(title), _dict_table(rows, [(_KEY, column), *known], (_KEY, *mono))]
        elif key in tables and not value:
            facts.append((f"Locked {key}", "none"))
        else:
            facts.append((_name(key), _fmt(value)))
    return ([Facts(facts)] if facts else []) + blocks


def _spelled(field: str, value: Any) -> Any:
    """A server's arguments and environment as a shell would show them."""
    if field == "args" and isinstance(value, list):
        return " ".join(str(arg) for arg in value)
    if field == "env" and isinstance(value, dict):
        return " ".join(f"{name}={item}" for name, item in value.items())
    return value


def _brief(answer: Any, fields: list[tuple[str, str]]) -> str:
    """One line of what an API answered: the fields it has, or the error it gave."""
    if not isinstance(answer, dict) or not answer:
        return DASH
    parts = [f"{label} {_fmt(answer[key])}" for key, label in fields if answer.get(key) not in (None, "")]
    for key in ("error", "detail"):
        if answer.get(key):
            parts.append(str(answer[key]))
    return "; ".join(parts) or _fmt(answer)


def _ok(answer: Any, fields: list[tuple[str, str]]) -> str:
    if not isinstance(answer, dict) or not answer:
        return DASH
    verdict = "ok" if answer.get("ok") is True else "FAILED" if answer.get("ok") is False else ""
    detail = _brief({k: v for k, v in answer.items() if k != "ok"}, fields)
    return f"{verdict}: {detail}" if verdict and detail != DASH else verdict or detail


def _unchecked(report: dict[str, Any], name: str) -> str | None:
    """Why ``name`` was not checked, when the report lists it under not_checked (None: it was checked)."""
    return next((_fmt(item.get("why")) for item in _dicts(report.get("not_checked")) if item.get("name") == name), None)


def _timings(answer: Any) -> str:
    """The server's own timings on the fixed prompt, in words."""
    if not isinstance(answer, dict) or not answer:
        return DASH
    parts = [f"{what} {_fmt(answer.get(tokens))} tokens at {_fmt(answer.get(rate))} tok/s"
             for what, tokens, rate in (("prompt", "prompt_tokens", "prompt_per_second"),
                                        ("generation", "predicted_tokens", "predicted_per_second"))
             if answer.get(rate) is not None]
    known = {"prompt_tokens", "prompt_per_second", "predicted_tokens", "predicted_per_second", "detail"}
    parts += [f"{_name(key)} {_fmt(value)}" for key, value in answer.items() if key not in known]
    return "; ".join(parts + ([str(answer["detail"])] if answer.get("detail") else [])) or DASH


def _endpoints(report: dict[str, Any]) -> Section:
    endpoints = report.get("endpoints")
    if not isinstance(endpoints, dict) or not endpoints:
        return _missing(report, "endpoints", "Endpoints")
    blocks: list[Any] = []
    for name, answer in endpoints.items():
        answer = answer if isinstance(answer, dict) else {}
        streams = answer.get("streams") if isinstance(answer.get("streams"), dict) else {}
        untried = _unchecked(report, f"tool call round trip {name}")  # then its raw answer is no verdict
        tool = f"not checked: {untried}" if untried is not None else _ok(answer.get("tool_call"), [
            ("tool_use", "tool_use block"), ("tool_name", "tool"), ("stop_reason", "stop reason"),
            ("final_stop_reason", "final stop reason")])
        blocks += [Heading(str(name)), Facts([
            ("Endpoint", _fmt(answer.get("endpoint"))),
            ("Health", _fmt(answer.get("health"))),
            ("Served model ids", _fmt(answer.get("served_ids"))),
            ("OpenAI API", _brief(answer.get("openai"), [("object", "object"), ("completion_tokens", "tokens"),
                                                         ("tokens_per_second", "tok/s")])),
            ("Anthropic API", _brief(answer.get("anthropic"), [("type", "type"), ("output_tokens", "tokens"),
                                                               ("stop_reason", "stop reason")])),
            ("API key", _brief(answer.get("auth"), [("required", "required"), ("anonymous_status", "without it HTTP"),
                                                    ("wrong_key_status", "wrong key HTTP")])),
            ("Tool call round trip", tool),
            ("OpenAI streaming", _ok(streams.get("openai"), [("chunks", "chunks"), ("done", "[DONE]")])),
            ("Anthropic streaming", _ok(streams.get("anthropic"), [("events", "events"),
                                                                   ("message_stop", "message_stop")])),
            *([("Server timings", _timings(answer["throughput"]))] if "throughput" in answer else []),
        ] + [(_name(key), _fmt(value)) for key, value in answer.items() if key not in {
            "endpoint", "health", "served_ids", "openai", "anthropic", "auth", "tool_call", "streams", "throughput"}])]
    return Section("endpoints", "Endpoints", _status(report, "endpoints"), blocks)


def _throughput(report: dict[str, Any]) -> Section:
    rows = _dicts(report.get("throughput"))
    if not rows:
        return _missing(report, "throughput", "Throughput")
    table = Table(["Service", "Model", "Prompt tok/s", "Band", "Generation tok/s", "Band", "Result"], [
        [_fmt(row.get("service")), _fmt(row.get("model")), _fmt(row.get("prompt_tok_s")),
         _range((row.get("band") or {}).get("prompt_tok_s"), "tok/s"), _fmt(row.get("gen_tok_s")),
         _range((row.get("band") or {}).get("gen_tok_s"), "tok/s"), _verdict(row.get("passed"))] for row in rows])
    blocks: list[Any] = [table]
    for row in rows:
        band = row.get("band") if isinstance(row.get("band"), dict) else None
        lines = [f"band source: {_fmt(band.get('source'))}; measured on: {_fmt(band.get('hardware'))}" if band
                 else "no band is known for this hardware and model, so the figures are not compared"]
        causes = [str(cause) for cause in row.get("causes") or []]
        lines.append("likely causes: " + "; ".join(causes) if causes else "likely causes: none found")
        if row.get("detail"):
            lines.append(str(row["detail"]))
        blocks += [Heading(f"{_fmt(row.get('service'))}"), Items(lines)]
    return Section("throughput", "Throughput", _status(report, "throughput"), blocks)


def _gpu_memory(report: dict[str, Any]) -> Section:
    """Each card's memory held by the plan's services against the plan's estimate for it."""
    key, title = "gpu_memory", TITLES["gpu_memory"]
    rows = _dicts(report.get("gpu_memory"))
    judged = [check for check in _dicts(report.get("checks")) if check.get("section") == key]
    if not rows:
        if not judged:
            return _missing(report, key, title)
        return Section(key, title, _status(report, key), [Items([_fmt(check.get("detail")) for check in judged])])

    def headroom(row: dict[str, Any]) -> str:
        planned, used = row.get("planned_mib"), row.get("used_mib")
        return _fmt(planned - used) if isinstance(planned, int) and isinstance(used, int) else DASH

    blocks: list[Any] = [
        Text("What each card holds for the plan's services once they serve (nvidia-smi's used memory of each "
             "service's process) against the plan's estimate for the card; holding more than planned fails."),
        Table(["GPU", "Card", "Planned (MiB)", "Held (MiB)", "Headroom (MiB)", "Other processes (MiB)", "Result"],
              [[_fmt(row.get("gpu")), _fmt(row.get("name")), _fmt(row.get("planned_mib")), _fmt(row.get("used_mib")),
                headroom(row), _fmt(row.get("other_mib")), _verdict(row.get("passed"))] for row in rows])]
    services = [{"gpu": row.get("gpu"), **item} for row in rows for item in _dicts(row.get("services"))]
    if services:
        blocks += [Heading("By service"),
                   _dict_table(services, [("gpu", "GPU"), ("service", "Service"), ("planned_mib", "Planned (MiB)"),
                                          ("used_mib", "Held (MiB)"), ("pids", "PIDs")], mono=("service",))]
    failed = [_fmt(check.get("detail")) for check in judged if check.get("passed") is not True]
    if failed:
        blocks += [Heading("What failed"), Items(failed)]
    return Section(key, title, _status(report, key), blocks)


def _gpu_series(burn_in: dict[str, Any]) -> dict[int, dict[str, list[tuple[float, float | None]]]]:
    """Per GPU index, each sampled field as (t, value) pairs; a field the driver did not report is None."""
    series: dict[int, dict[str, list[tuple[float, float | None]]]] = {}
    for sample in _dicts(burn_in.get("samples")):
        t = sample.get("t")
        if not isinstance(t, int | float):
            continue
        for gpu in _dicts(sample.get("gpus")):
            if not isinstance(gpu.get("index"), int):
                continue
            fields = series.setdefault(gpu["index"], {})
            for key in ("temp_c", "memory_temp_c", "power_w"):
                value = gpu.get(key)
                fields.setdefault(key, []).append((float(t), float(value) if isinstance(value, int | float) else None))
            fields.setdefault("throttle", []).extend((float(t), reason) for reason in gpu.get("throttle") or [])
    return series


def _has_values(pairs: list[tuple[float, Any]]) -> bool:
    return any(value is not None for _, value in pairs)


def _tok_series(burn_in: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    series = burn_in.get("series") if isinstance(burn_in.get("series"), dict) else {}
    return {str(name): [(float(point["t"]), float(point["tok_s"])) for point in _dicts(points)
                        if isinstance(point.get("t"), int | float) and isinstance(point.get("tok_s"), int | float)]
            for name, points in series.items()}


def windowed_rates(points: list[tuple[float, float]], size: int = WINDOW_REQUESTS) -> list[tuple[float, float]]:
    """Per-request rates, in time order, as the median of each ``size`` consecutive requests at the middle of their
    span. A reply whose last tokens came in one network chunk has a rate of hundreds of thousands of tok/s; a window's
    median leaves such a burst out. Requests left over join the last window."""
    ordered = sorted(points)
    windows = [ordered[start:start + size] for start in range(0, len(ordered), size)]
    if len(windows) > 1 and len(windows[-1]) < size:
        windows[-2:] = [windows[-2] + windows[-1]]
    return [((window[0][0] + window[-1][0]) / 2, statistics.median(rate for _, rate in window)) for window in windows]


def _rate_windows(burn_in: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    return {name: windowed_rates(points) for name, points in _tok_series(burn_in).items() if points}


def rate_axis(windows: dict[str, list[tuple[float, float]]]) -> float:
    """The top of the tok/s axis: scaled to the bulk of each service's windows (a quarter above its 95th percentile),
    so a run of bursts that outlasts a window's median cannot flatten the rest of the plot."""
    tops = []
    for points in windows.values():
        rates = sorted(rate for _, rate in points)
        if rates:
            tops.append(min(rates[-1] * 1.1, rates[round(0.95 * (len(rates) - 1))] * 1.25))
    return max(tops, default=0.0) or 1.0


def plot_gaps(report: dict[str, Any]) -> dict[str, str]:
    """A sentence for each plot that cannot be drawn, saying why (empty when both are drawn)."""
    burn_in = report.get("burn_in")
    if not isinstance(burn_in, dict):
        return {"temperatures": "No burn-in ran, so there is no temperature plot.",
                "throughput": "No burn-in ran, so there is no generation speed plot."}
    gaps = {}
    if not any(_has_values(fields.get("temp_c", [])) or _has_values(fields.get("memory_temp_c", []))
               for fields in _gpu_series(burn_in).values()):
        gaps["temperatures"] = ("No GPU temperature was sampled during the burn-in (no NVIDIA GPU, or nvidia-smi "
                                "reported none), so there is no temperature plot.")
    if not any(_tok_series(burn_in).values()):
        gaps["throughput"] = "No generation speed was recorded during the burn-in, so there is no tok/s plot."
    return gaps


def _burn_in(report: dict[str, Any]) -> Section:
    burn_in = report.get("burn_in")
    if not isinstance(burn_in, dict):
        return _missing(report, "burn_in", "Burn-in")
    boot = burn_in.get("boot_id") if isinstance(burn_in.get("boot_id"), dict) else {}
    same_boot = boot.get("before") == boot.get("after") if boot.get("before") else None
    blocks: list[Any] = [Facts([
        ("Duration", f"{_fmt(burn_in.get('duration_s'))} s"),
        ("GPUs sampled", _fmt(burn_in.get("gpu_sampled"))),
        ("Same boot throughout", _fmt(same_boot) if same_boot is not None else DASH),
    ])]
    problems = [str(problem) for problem in burn_in.get("problems") or []]
    blocks.append(Items(problems) if problems else Text("No problem seen: no throttling, reboot, restart or "
                                                        "request error."))
    requests = burn_in.get("requests") if isinstance(burn_in.get("requests"), dict) else {}
    restarts = burn_in.get("restarts") if isinstance(burn_in.get("restarts"), dict) else {}
    tok = _rate_windows(burn_in)
    names = list(dict.fromkeys([*requests, *restarts, *tok]))
    if names:
        rows = []
        for name in names:
            done = requests.get(name) if isinstance(requests.get(name), dict) else {}
            restart = restarts.get(name) if isinstance(restarts.get(name), dict) else {}
            speeds = [value for _, value in tok.get(name, [])]
            rows.append([name, _fmt(done.get("ok")), _fmt(done.get("errors")),
                         f"{min(speeds):.1f} / {statistics.median(speeds):.1f} / {max(speeds):.1f}" if speeds
                         else DASH,
                         f"{_fmt(restart.get('before'))} → {_fmt(restart.get('after'))}"
                         + (", new invocation" if restart.get("invocation_changed") else "") if restart else DASH,
                         "; ".join(str(message) for message in done.get("messages") or []) or DASH])
        blocks += [Heading("Services under load"),
                   Table(["Service", "Requests ok", "Errors",
                          f"tok/s, median of each {WINDOW_REQUESTS} requests: min / median / max", "Restarts",
                          "Error messages"], rows)]
    gpus = _gpu_series(burn_in)
    if gpus:
        rows = []
        for index, fields in sorted(gpus.items()):
            def peak(key: str, fields: dict = fields) -> str:
                values = [value for _, value in fields.get(key, []) if value is not None]
                return _fmt(max(values)) if values else DASH
            reasons = sorted({str(reason) for _, reason in fields.get("throttle", [])})
            rows.append([str(index), peak("temp_c"), peak("memory_temp_c"), peak("power_w"), _fmt(reasons) if reasons
                         else "none"])
        blocks += [Heading("GPUs under load"),
                   Table(["GPU", "Peak core °C", "Peak memory °C", "Peak power (W)", "Throttle reasons seen"], rows)]
    gaps = plot_gaps(report)
    for name, title in (("temperatures", "GPU temperatures over the burn-in"),
                        ("throughput", f"Generation speed over the burn-in: the median of each {WINDOW_REQUESTS} "
                                       "requests")):
        blocks.append(Text(gaps[name]) if name in gaps else Plot(name, title))
    top = rate_axis(tok)
    above = {name: [rate for _, rate in points if rate > top] for name, points in tok.items()}
    if "throughput" not in gaps and any(above.values()):
        blocks.append(Text(f"Windows above the axis, which is scaled to the bulk of the rates ({top:.1f} tok/s): "
                           + "; ".join(f"{name}: {len(rates)} window(s), up to {max(rates):.1f} tok/s"
                                       for name, rates in above.items() if rates) + "."))
    return Section("burn_in", "Burn-in", _status(report, "burn_in", "burn-in"), blocks)


def _thermal(report: dict[str, Any]) -> Section:
    guard = report.get("thermal_guard")
    if not isinstance(guard, dict):
        return _missing(report, "thermal_guard", "Thermal guard")
    settings = [("Installed", _fmt(guard.get("installed"))), ("Running", _fmt(guard.get("active"))),
                ("Warns at", f"{_fmt(guard.get('warn_c'))} °C"), ("Stops services at", f"{_fmt(guard.get('stop_c'))} °C"),
                ("Starts them again below", f"{_fmt(guard.get('resume_c'))} °C")]
    settings += [(_name(key), _fmt(value)) for key, value in guard.items()
                 if key not in {"installed", "active", "warn_c", "stop_c", "resume_c", "events"}]
    events = _dicts(guard.get("events"))
    blocks: list[Any] = [Facts(settings), Heading("Events")]
    if events:
        blocks.append(_dict_table(events[:EVENTS_SHOWN], [
            ("time", "Time"), ("kind", "Kind"), ("gpu", "GPU"), ("temp_c", "Core °C"), ("memory_temp_c", "Memory °C"),
            ("service", "Service"), ("message", "Message")], mono=("service",)))
        if len(events) > EVENTS_SHOWN:
            blocks.append(Text(f"… and {len(events) - EVENTS_SHOWN} more events (all are in the JSON report)."))
    else:
        blocks.append(Text("No event: the guard never warned or stopped a service."))
    return Section("thermal_guard", "Thermal guard", _status(report, "thermal", "thermal_guard"), blocks)


def _power(report: dict[str, Any]) -> Section:
    power = report.get("power")
    if not isinstance(power, dict):
        return _missing(report, "power", "Power limits")
    limits = _dicts(power.get("limits"))
    blocks: list[Any] = [Facts([("Persistence mode", _fmt(power.get("persistence")))])]
    if limits:
        blocks.append(Table(["GPU", "Limit (W)", "Applied", "Card's range (W)"],
                            [[_fmt(limit.get("gpu")), _fmt(limit.get("watts")), _fmt(limit.get("applied")),
                              _range(limit.get("range"), "W")] for limit in limits]))
    else:
        blocks.append(Text("No power limit is set: the cards run at their default limit."))
    return Section("power", "Power limits", _status(report, "power"), blocks)


def _seal(report: dict[str, Any]) -> Section:
    seal = report.get("seal")
    if not isinstance(seal, dict):
        return Section("seal", "Seal", None, [Text(f"not sealed yet: controller seal {_fmt(report.get('box'))} "
                                                   "hands a certified box over to its buyer")])
    blocks: list[Any] = [Facts([(_name(key), _fmt(value)) for key, value in seal.items()
                                if not isinstance(value, list | dict)])]
    for key, value in seal.items():
        if isinstance(value, list) and all(not isinstance(item, dict | list) for item in value):
            blocks += [Heading(_name(key)), Items([str(item) for item in value]) if value else Text(DASH)]
        elif isinstance(value, list | dict):
            blocks += [Heading(_name(key)), Pre(json.dumps(value, indent=2, sort_keys=True, default=str))]
    return Section("seal", "Seal", _status(report, "seal"), blocks)


# ---------------------------------------------------------------- plots


def _label(text: str) -> str:
    """Text matplotlib shows as written: no mathtext, and a leading underscore does not hide a legend entry."""
    text = text.replace("$", r"\$")
    return " " + text if text.startswith("_") else text


def _svg(figure: Any, salt: str) -> str:
    import matplotlib

    buffer = io.StringIO()
    # Text stays text (the page's font); a salt per plot keeps the ids of two inline SVGs apart.
    with _SVG_MUTEX, matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": f"certify-{salt}"}):
        figure.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # inline in HTML: no XML declaration or DOCTYPE


def plots(report: dict[str, Any]) -> dict[str, str]:
    """SVG text of the burn-in plots: ``temperatures`` (per GPU, core and memory) and ``throughput``
    (generation tok/s per service); a plot without data is left out (``plot_gaps`` says why)."""
    burn_in = report.get("burn_in")
    if not isinstance(burn_in, dict):
        return {}
    from matplotlib.figure import Figure  # no pyplot: no GUI backend and no global figure state

    gaps = plot_gaps(report)
    duration = burn_in.get("duration_s") if isinstance(burn_in.get("duration_s"), int | float) else 0
    scale, unit = (60.0, "minutes") if duration >= 600 else (1.0, "seconds")
    result = {}
    if "temperatures" not in gaps:
        figure = Figure(figsize=(9, 3.8), layout="constrained")
        axes = figure.add_subplot()
        for number, (index, fields) in enumerate(sorted(_gpu_series(burn_in).items())):
            color = f"C{number % 10}"
            for key, style, what in (("temp_c", "-", "core"), ("memory_temp_c", "--", "memory")):
                pairs = fields.get(key, [])
                if _has_values(pairs):
                    axes.plot([t / scale for t, _ in pairs], [math.nan if v is None else v for _, v in pairs],
                              style, color=color, label=f"GPU {index} {what}")
        guard = report.get("thermal_guard") if isinstance(report.get("thermal_guard"), dict) else {}
        for key, what, color in (("warn_c", "guard warns", "orange"), ("stop_c", "guard stops", "red")):
            if isinstance(guard.get(key), int | float):
                axes.axhline(guard[key], color=color, linestyle=":", linewidth=1, label=f"{what} ({guard[key]} °C)")
        axes.set(xlabel=f"time ({unit})", ylabel="°C")  # the page's caption titles it
        axes.grid(alpha=0.3)
        axes.legend(loc="best", fontsize="small")
        result["temperatures"] = _svg(figure, "temperatures")
    if "throughput" not in gaps:
        figure = Figure(figsize=(9, 3.8), layout="constrained")
        axes = figure.add_subplot()
        windows = _rate_windows(burn_in)
        for name, pairs in windows.items():
            axes.plot([t / scale for t, _ in pairs], [v for _, v in pairs], marker=".", label=_label(name))
        axes.set(xlabel=f"time ({unit})", ylabel=f"generation tok/s (median of {WINDOW_REQUESTS} requests)")
        axes.set_ylim(0, rate_axis(windows))
        axes.grid(alpha=0.3)
        axes.legend(loc="best", fontsize="small")
        result["throughput"] = _svg(figure, "throughput")
    return result


# ---------------------------------------------------------------- Markdown


def _md(text: str) -> str:
    """Prose in Markdown: characters that would start markup or HTML, or break a table row, are escaped."""
    text = " ".join(str(text).split())
    for char in "\\`*_[]<>|#":
        text = text.replace(char, "\\" + char)
    return text


def _longest_backtick_run(text: str) -> int:
    return max((len(run) for run in re.findall(r"`+", text)), default=0)


def _md_code(text: str) -> str:
    """A value as a code span in a table cell. CommonMark ends a span at the first backtick run as long as its
    fence, and backslashes escape nothing inside it, so the fence is one backtick longer than any run in the value:
    no value can end its span early and put the rest (an ``<img onerror>``) in the page as raw HTML. A pipe is
    escaped for the table row (GFM unescapes it inside spans too); newlines and runs of spaces become one space."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    if not text or text == DASH:
        return DASH
    fence = "`" * (_longest_backtick_run(text) + 1)
    pad = " " if "`" in text else ""  # one space each side, which CommonMark strips, keeps a backtick off the fence
    return f"{fence}{pad}{text}{pad}{fence}"


def _md_block(block: Any) -> list[str]:
    if isinstance(block, Heading):
        return [f"### {_md(block.text)}", ""]
    if isinstance(block, Text):
        return [_md(block.text), ""]
    if isinstance(block, Items):
        return [*(f"- {_md(item)}" for item in block.items), ""]
    if isinstance(block, Facts):
        return [*(f"- **{_md(label)}:** {_md(value)}" for label, value in block.rows), ""]
    if isinstance(block, Pre):
        # Only a line of at least as many backticks closes the block (up to three spaces before them included).
        fence = "`" * max(3, _longest_backtick_run(block.text) + 1)
        return [fence + "json", block.text, fence, ""]
    if isinstance(block, Table):
        lines = ["| " + " | ".join(_md(column) for column in block.columns) + " |",
                 "|" + "|".join(" --- " for _ in block.columns) + "|"]
        for row in block.rows:
            cells = [_md_code(cell) if i in block.mono else f"**{cell}**" if cell in ("PASS", "FAIL") else _md(cell)
                     for i, cell in enumerate(row)]
            lines.append("| " + " | ".join(cells) + " |")
        return [*lines, ""]
    if isinstance(block, Plot):
        return [f"*{_md(block.title)}: a plot in the HTML report.*", ""]
    raise TypeError(f"unknown block {block!r}")


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown, every section in order; text from the box is escaped."""
    lines = [f"# Certification of {_md(_fmt(report.get('box')))}: "
             + ("PASSED" if report.get("passed") is True else "FAILED"), ""]
    for section in sections(report):
        badge = {"pass": " — PASS", "fail": " — FAIL", "not checked": " — not checked"}.get(section.status or "", "")
        lines += [f"## {section.title}{badge}", ""]
        for block in section.blocks:
            lines += _md_block(block)
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------- HTML


TABLE_PX = 1036  # the tables' width on the page: its 1100 px less the padding
TEXT_PX, MONO_PX, HEADER_PX, CELL_PX = 8.8, 7.6, 11.0, 22  # a character of text, code, a header (bold); padding


def column_widths(table: Table) -> list[float]:
    """Each column's share of its table in percent, for a fixed table layout: from the longest text each column holds,
    never below what its header's words, a number or a readable piece of a hash or file name need. Long names and
    hashes then wrap inside their own column, instead of widening the table past the page or squeezing a neighbour to
    a letter a line."""
    want, least = [], []
    for i, column in enumerate(table.columns):
        cells = [str(row[i]) for row in table.rows if i < len(row)]
        px = MONO_PX if i in table.mono else TEXT_PX
        header = max((len(word) for word in str(column).split()), default=0) * HEADER_PX
        longest = max((len(cell) for cell in cells), default=0)
        word = max((len(part) for cell in cells for part in cell.split()), default=0)
        floor = max(header, (min(longest, 16) if i in table.mono else min(word, 12)) * px) + CELL_PX
        least.append(floor)
        want.append(max(floor, min(longest, 80) * px + CELL_PX))
    if sum(want) > TABLE_PX:  # too wide: the wide columns give up room in proportion, down to their floors
        spare, extra = max(TABLE_PX - sum(least), 0), [w - f for w, f in zip(want, least, strict=True)]
        want = [f + e * spare / sum(extra) for f, e in zip(least, extra, strict=True)] if sum(extra) else least
    total = sum(want) or 1
    return [round(100 * width / total, 1) for width in want]


_ENVIRONMENT = jinja2.Environment(loader=jinja2.PackageLoader("controller", "templates"), autoescape=True,
                                  undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def html(report: dict[str, Any], svgs: dict[str, str] | None = None, keys: dict[str, str] | None = None) -> str:
    """One self-contained page (inline CSS and SVG, nothing fetched); every value from the report is escaped.

    ``svgs`` are the plots when already drawn (``plots``); ``keys`` (service -> API key) only for the buyer's copy.
    """
    svgs = plots(report) if svgs is None else svgs
    template = _ENVIRONMENT.get_template("certify.html.j2")
    return template.render(
        report=report, box=_fmt(report.get("box")), passed=report.get("passed") is True,
        sections=sections(report), svgs={name: Markup(svg) for name, svg in svgs.items()},  # matplotlib's own XML
        keys=keys or {}, kind=lambda block: type(block).__name__, widths=column_widths)


# ---------------------------------------------------------------- files


def browser() -> str | None:
    """The Chromium on PATH that prints the PDF, or None."""
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


def print_pdf(html_path: Path, pdf_path: Path, timeout: float = PDF_TIMEOUT_S) -> str | None:
    """Print ``html_path`` to ``pdf_path`` with headless Chromium; None when printed, else why not (one line).

    The PDF appears whole or not at all; a private profile lets several prints run at once.
    """
    chromium = browser()
    if chromium is None:
        return "no PDF: no Chromium on PATH (chromium or chromium-browser; scripts/bootstrap.sh installs it)"
    with tempfile.TemporaryDirectory(prefix="certify-pdf-") as profile:
        partial = Path(profile) / "report.pdf"
        command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
                   f"--user-data-dir={profile}/profile", "--no-pdf-header-footer", f"--print-to-pdf={partial}",
                   html_path.resolve().as_uri()]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return f"no PDF: Chromium did not print within {timeout:g} s"
        except OSError as exc:
            return f"no PDF: Chromium did not start: {exc}"
        if not partial.is_file() or partial.read_bytes()[:5] != b"%PDF-":
            said = [line for line in (done.stderr or "").splitlines() if line.strip()]
            return f"no PDF: Chromium exited {done.returncode} without printing" + (f": {said[-1]}" if said else "")
        write_atomic(pdf_path, partial.read_bytes())
    return None


def write_reports(inventory: Inventory, report: dict[str, Any]) -> dict[str, str | None]:
    """Write the box's certification report into the inventory: Markdown, HTML and, when a Chromium prints it, PDF,
    then JSON (``Inventory.certify_files``).

    Sets ``report["reports"]`` (absolute paths; ``pdf`` null when none, ``pdf_note`` says why) before the
    JSON is written, so the JSON names its own files, and returns it. A PDF that fails is noted, never raised.
    """
    paths = inventory.certify_files(report["box"])
    write_atomic(paths["markdown"], markdown(report))
    write_atomic(paths["html"], html(report))
    note = print_pdf(paths["html"], paths["pdf"])
    if note is not None:
        paths["pdf"].unlink(missing_ok=True)  # an older run's PDF would contradict this report
    report["reports"] = {kind: (None if kind == "pdf" and note else str(path)) for kind, path in paths.items()}
    report["reports"]["pdf_note"] = note
    write_atomic(paths["json"], json.dumps(report, indent=2, default=str) + "\n")
    return report["reports"]


def write_buyer_copy(folder: Path, report: dict[str, Any], keys: dict[str, str]) -> dict[str, str]:
    """The buyer's copy: the report plus the box's API keys (service -> key), readable by the owner only.

    ``<box>.buyer.md`` and ``<box>.buyer.html`` (mode 0600) are the only files that hold the keys.
    """
    folder = folder.resolve()
    paths = {"markdown": folder / f"{report['box']}.buyer.md", "html": folder / f"{report['box']}.buyer.html"}
    lines = ["", "## API keys", "",
             "Keep these secret: each lets a client use the service it names. They replace every earlier key.", "",
             "| Service | API key |", "| --- | --- |",
             *(f"| {_md(name)} | {_md_code(key)} |" for name, key in keys.items()), ""]
    write_atomic(paths["markdown"], markdown(report) + "\n".join(lines), private=True)
    write_atomic(paths["html"], html(report, keys=keys), private=True)
    return {kind: str(path) for kind, path in paths.items()}
