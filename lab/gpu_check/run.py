"""The check from end to end: build (or take) the engine, record the cases, ask nvidia-smi, trace the server, report.

The CUDA build runs in the background while the models are written and nvidia-smi is asked, so a fresh
16-core machine spends most of its time compiling (about five minutes for llama-server alone). ``--cpu``
runs the same pipeline on the cached CPU engine with no build and no GPU, which is how CI tests it.
"""

from __future__ import annotations

import importlib
import json
import lzma
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.gpu_check import bundle, procs
from lab.gpu_check.build import Source

BUDGET_S = 9 * 60
DEFAULT_TRACE_CASE = "gpu-qwen3moe-c32768-np4-split-q4_0"
MARKER = ".gpu-check"


@dataclass
class Options:
    out: Path
    cpu: bool = False
    cases: list[str] | None = None
    trace_case: str | None = None
    bundle: Path | None = None
    source: Path | None = None
    wheels: Path | None = None
    unit: Path | None = None
    syscall_filter: Path | None = None
    nvidia_smi: str | None = None
    server: Path | None = None
    arch: str | None = None
    strace: str | None = None
    jobs: int = field(default_factory=lambda: os.cpu_count() or 2)
    trace: bool = True
    copy_to: Path | None = None
    build_timeout: float = 600.0

    def from_bundle(self) -> None:
        """Make the paths absolute (servers run in a work folder) and fill what was not given from the bundle."""
        for name in ("bundle", "source", "wheels", "unit", "syscall_filter", "server", "copy_to"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.resolve())
        for name in ("nvidia_smi", "strace"):
            value = getattr(self, name)
            if value is not None and os.sep in value:
                setattr(self, name, os.path.abspath(value))
        if self.bundle is None:
            return
        b = self.bundle
        self.source = self.source or (b / bundle.SOURCE if (b / bundle.SOURCE).is_file() else None)
        self.wheels = self.wheels or (b / bundle.WHEELS if (b / bundle.WHEELS).is_dir() else None)
        self.unit = self.unit or (b / bundle.UNIT if (b / bundle.UNIT).is_file() else None)
        self.syscall_filter = self.syscall_filter or (b / bundle.SYSCALL_FILTER
                                                      if (b / bundle.SYSCALL_FILTER).is_file() else None)


@dataclass
class Section:
    """One part of the report: a verdict, a headline and its detail lines."""

    name: str
    status: str = "skip"
    headline: str = ""
    lines: list[str] = field(default_factory=list)

    def text(self) -> str:
        head = f"{self.name:<10} {self.status.upper():<4} {self.headline}"
        return "\n".join([head, *(f"  {line}" for line in self.lines)])


class Report:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.sections: list[Section] = []
        self.facts: dict[str, Any] = {}
        self.started = time.monotonic()

    def section(self, name: str) -> Section:
        section = Section(name)
        self.sections.append(section)
        return section

    @property
    def failed(self) -> bool:
        return any(section.status == "fail" for section in self.sections)

    def text(self) -> str:
        elapsed = time.monotonic() - self.started
        verdict = "FAIL" if self.failed else "PASS"
        what = ", ".join(f"{k} {v}" for k, v in self.facts.items() if k in ("engine", "gpu", "driver", "arch"))
        over = f" (over the {BUDGET_S // 60}-minute budget)" if elapsed > BUDGET_S else ""
        return "\n".join([f"gpu check: {verdict} in {elapsed / 60:.1f} min{over}; {what}",
                          *(section.text() for section in self.sections)]) + "\n"

    def write(self) -> None:
        elapsed = round(time.monotonic() - self.started, 1)
        (self.out / "summary.txt").write_text(self.text())
        (self.out / "summary.json").write_text(json.dumps({
            "passed": not self.failed, "seconds": elapsed, "facts": self.facts,
            "sections": [{"name": s.name, "status": s.status, "headline": s.headline, "lines": s.lines}
                         for s in self.sections]}, indent=1) + "\n")


# ---- the environment -------------------------------------------------------------------------------------------

def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def python_packages(wheels: Path | None, work: Path) -> str:
    """Make pydantic and ansible-core's module_utils importable, from the bundle's wheels where missing."""
    missing = [name for name in ("pydantic", "ansible.module_utils.basic") if not _importable(name)]
    if not missing:
        return "all present"
    if wheels is None:
        return f"missing {', '.join(missing)} (no wheels given)"
    target = work / "pylib"
    files = [str(path) for path in sorted(wheels.glob("*.whl"))]
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target",
                    str(target), *files], check=True)
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    still = [name for name in missing if not _importable(name)]
    return f"installed {len(files)} wheels" + (f"; still missing {', '.join(still)}" if still else "")


def gguf_package(source: Source, work: Path) -> str:
    if _importable("gguf"):
        return "installed"
    from lab.gpu_check.build import source_gguf_path

    sys.path.insert(0, str(source_gguf_path(source, work)))
    return "the source's gguf-py"


def _clear_out(out: Path) -> None:
    if out.exists():
        if any(out.iterdir()) and not (out / MARKER).exists():
            raise SystemExit(f"{out} exists and is not an earlier check's output: name an empty or new folder")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / MARKER).write_text("written by python -m lab.gpu_check\n")


def _first_line(argv: list[str], last: bool = False) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return (lines[-1] if last else lines[0]) if lines else None


def machine_facts() -> dict[str, Any]:
    """Where the record was made, for the README of a fixture made from it."""
    from lab.gpu_check.build import find_nvcc

    nvcc = find_nvcc()
    return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "kernel": os.uname().release,
            "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "cmake": _first_line(["cmake", "--version"]), "nvcc": _first_line([nvcc, "--version"], last=True)
            if nvcc else None}


# ---- parts ---------------------------------------------------------------------------------------------------

def gpu_facts(smi: str, report: Report) -> str:
    done = subprocess.run([smi, "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=60, check=False)
    first = next((line for line in done.stdout.splitlines() if line.strip()), "")
    cells = [cell.strip() for cell in first.split(",")]
    if done.returncode != 0 or len(cells) != 3:
        raise RuntimeError(f"nvidia-smi answered {done.returncode}: {(done.stdout + done.stderr).strip()[:300]}")
    from lab.gpu_check.build import arch_from_compute_cap

    report.facts.update(gpu=cells[0], compute_cap=cells[1], driver=cells[2])
    return arch_from_compute_cap(cells[1])


def nvidia_smi_part(smi: str | None, out: Path, section: Section) -> list[dict[str, Any]]:
    """Ask every product query and the probe; returns the probed GPUs (index, minor_number) for the unit."""
    from lab.gpu_check import smi as smi_mod

    if smi is None:
        section.headline = "no nvidia-smi on this machine"
        return []
    parsers = smi_mod.load_parsers()
    queries = smi_mod.product_queries(parsers)
    outputs, rcs = smi_mod.run_queries(smi, queries, out / "nvidia-smi")
    smi_mod.list_dev_nodes(out / "nvidia-smi")
    probe = smi_mod.run_probe(smi, out / smi_mod.PROBE_FOLDER)
    answers = smi_mod.check_outputs(parsers, queries, outputs, probe, rcs)
    (out / "nvidia-smi" / "queries.json").write_text(json.dumps(
        [{"file": a.file, "command": a.command, "users": a.users, "rc": a.rc, "status": a.status,
          "parsed": a.parsed, "problems": a.problems, "skipped": a.skipped} for a in answers], indent=1) + "\n")
    section.lines = [answer.line() for answer in answers]
    failed = [a for a in answers if a.status == "fail"]
    read = [a for a in answers if a.status == "pass"]
    section.status = "fail" if failed else ("pass" if read else "skip")
    section.headline = f"{len(read)} of {len(answers)} answers read by the product's parsers" + (
        f"; {len(failed)} with problems" if failed else "")
    try:
        from controller.stages.probe.parse import parse_outputs

        profile = parse_outputs(probe, model_dir="/")
        return [{"index": g.index, "minor_number": g.minor_number if g.minor_number is not None else g.index}
                for g in profile.gpus]
    except ImportError:
        return []


def unit_policy(opts: Options, gpus: list[dict[str, Any]], out: Path) -> tuple[Any, Any, str]:
    from lab.gpu_check import unit

    if opts.unit is not None:
        text, where = opts.unit.read_text(), f"rendered beforehand ({opts.unit})"
    else:
        text, where = unit.render_unit(gpus), f"rendered here for GPUs {[g['index'] for g in gpus]}"
    filter_text, filter_where = unit.syscall_groups_text(opts.syscall_filter)
    (out / "unit").mkdir(exist_ok=True)
    (out / "unit" / "llama.service").write_text(text)
    (out / "unit" / "syscall-filter.txt").write_text(filter_text)
    policy = unit.parse_unit(text)
    resolved = unit.resolve_filter(policy.syscall_filter, unit.read_syscall_groups(filter_text))
    return policy, resolved, f"unit {where}; system call groups from {filter_where}"


def find_strace(opts: Options) -> tuple[str, str | None] | None:
    if opts.strace:
        return opts.strace, None
    if opts.bundle is not None:
        found = bundle.strace_command(opts.bundle / bundle.STRACE_ROOT)
        if found:
            return found
    system = shutil.which("strace")
    return (system, None) if system else None


def run_trace(group: procs.Group, strace: tuple[str, str | None], server: Path, case: dict[str, Any], work: Path,
              out: Path, *, health_timeout: float = 300.0) -> tuple[str, str | None]:
    """Start the case's server under ``strace -f``, wait for health, send one chat, SIGTERM it; returns the
    trace text and an error (None when all went as planned)."""
    from lab.gpu_check import cases

    trace_file = work / "strace.txt"
    binary, lib = strace
    env = dict(os.environ)
    argv = [binary, "-f", "-qq", "-s", "256", "-o", str(trace_file)]
    if lib:
        original = os.environ.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = lib + (os.pathsep + original if original else "")
        argv += ["-E", f"LD_LIBRARY_PATH={original}" if original else "LD_LIBRARY_PATH"]
    port = procs.free_port()
    args = cases.server_args(case, f"models/{cases.model_file(case['model'])}", port)
    log = out / "trace-server.log"
    process = group.start([*argv, str(server), *args], log, cwd=work, env=env)
    error = None
    try:
        server_pid = None
        deadline = time.monotonic() + 20
        while server_pid is None and time.monotonic() < deadline and process.poll() is None:
            found = procs.children(process.pid)
            server_pid = found[0] if found else None
            time.sleep(0.05)
        procs.wait_healthy(process, f"http://127.0.0.1:{port}", health_timeout)
        reply = procs.chat(f"http://127.0.0.1:{port}")
        (out / "trace-chat.txt").write_text(reply + "\n")
        if server_pid is not None:
            os.kill(server_pid, signal.SIGTERM)
        process.wait(timeout=60)
    except (procs.NotHealthy, OSError, subprocess.TimeoutExpired, KeyError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        group.stop(process)
    text = trace_file.read_text(errors="replace") if trace_file.exists() else ""
    return text, error


def trace_part(opts: Options, group: procs.Group, server: Path, selected: list[dict[str, Any]], work: Path,
               out: Path, engine: str, gpus: list[dict[str, Any]], section: Section) -> None:
    from lab.gpu_check import trace

    strace = find_strace(opts)
    if not opts.trace:
        section.headline = "not asked (--no-trace)"
        return
    if strace is None:
        section.headline = "strace is not installed (scripts/bootstrap.sh installs it; the bundle carries one)"
        section.status = "fail" if not opts.cpu else "skip"
        return
    names = [case["name"] for case in selected]
    wanted = opts.trace_case or (DEFAULT_TRACE_CASE if DEFAULT_TRACE_CASE in names else names[0])
    case = next((c for c in selected if c["name"] == wanted), None)
    if case is None:
        section.status, section.headline = "fail", f"trace case {wanted} is not among the cases run"
        return
    from lab.gpu_check.unit import RenderError

    try:
        policy, resolved, where = unit_policy(opts, gpus, out)
    except (RenderError, FileNotFoundError, KeyError) as exc:
        section.status, section.headline = "fail", f"no unit to check against: {exc}"
        return
    text, error = run_trace(group, strace, server, case, work, out)
    facts = trace.parse_strace(text)
    (out / f"{engine}-syscalls.txt").write_text(trace.format_syscalls(facts))
    (out / f"{engine}-paths-opened.txt").write_text(trace.format_paths(facts))
    (out / "strace.txt.xz").write_bytes(lzma.compress(text.encode(), preset=6))
    nodes_file = out / "nvidia-smi" / "dev-nodes.txt"
    nodes = trace.parse_dev_nodes(nodes_file.read_text()) if nodes_file.exists() else {}
    checks = trace.check_trace(facts, policy, resolved, nodes)
    (out / "trace-checks.json").write_text(json.dumps(
        {"case": case["name"], "error": error, "where": where,
         "checks": [{"name": c.name, "status": c.status, "detail": c.detail} for c in checks],
         "socket_families": dict(facts.socket_families or {}), "programs": facts.programs}, indent=1) + "\n")
    section.lines = [where, *(check.line() for check in checks)]
    if error:
        section.lines.insert(0, f"the traced run went wrong: {error}")
    failed = [c for c in checks if c.status == "fail"]
    section.status = "fail" if failed or error or not facts.syscalls else "pass"
    section.headline = (f"{case['name']}: {len(facts.syscalls)} system calls, "
                        f"{sum(1 for _ in facts.devices_touched())} device paths opened; "
                        + (f"{len(failed)} check(s) failed" if failed else "within the unit's sandbox"))


def build_part(opts: Options, group: procs.Group, source: Source, arch: str | None, work: Path, out: Path,
               section: Section) -> tuple[Path | None, Any]:
    """The server to use now, or the running build to wait for (``finish_build``)."""
    if opts.server is not None:
        section.status, section.headline = "pass", f"given: {opts.server}"
        return opts.server, None
    if opts.cpu:
        from lab import engine_build

        folder = engine_build.build(opts.jobs)
        section.status, section.headline = "pass", f"the cached CPU engine {folder}"
        return folder / "llama-server", None
    from lab.gpu_check import build

    assert arch is not None
    cached = build.cached_server(arch, source)
    if (cached / build.TARGET).is_file():
        section.status, section.headline = "pass", f"cached: {cached} (sm_{arch})"
        return cached / build.TARGET, None
    nvcc = build.find_nvcc()
    if nvcc is None:
        section.status, section.headline = "fail", "nvcc is not installed (the CUDA toolkit's bin/ on PATH)"
        return None, None
    commands, build_dir = build.start_build(arch, source, work / "engine", out / "build.log", opts.jobs, nvcc)
    script = " && ".join(shlex.join(command) for command in commands)
    process = group.start(["sh", "-c", script], out / "build.log")
    return None, (process, build_dir, cached, time.monotonic())


def finish_build(opts: Options, group: procs.Group, pending: Any, source: Source, arch: str,
                 out: Path, section: Section) -> Path | None:
    from lab.gpu_check import build

    process, build_dir, cached, started = pending
    try:
        rc = process.wait(timeout=max(1.0, opts.build_timeout - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        group.stop(process)
        section.status, section.headline = "fail", f"the build took over {opts.build_timeout:.0f} s (see build.log)"
        return None
    group.stop(process)
    took = time.monotonic() - started
    if rc != 0:
        tail = "\n".join((out / "build.log").read_text(errors="replace").splitlines()[-8:])
        section.status, section.headline = "fail", f"cmake failed ({rc}) after {took:.0f} s"
        section.lines = tail.splitlines()
        return None
    folder = build.install_build(build_dir, cached, arch, source)
    shutil.copy2(folder / "BUILD-INFO", out / "BUILD-INFO")
    section.status = "pass"
    section.headline = f"llama-server for sm_{arch} built in {took / 60:.1f} min with {opts.jobs} jobs: {folder}"
    return folder / build.TARGET


def pack(out: Path) -> Path:
    archive = out.parent / f"{out.name}.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(out, arcname=out.name)
    return archive


# ---- the whole check -----------------------------------------------------------------------------------------

def run_check(opts: Options) -> int:
    """Run the check; returns the exit status (1 when a part failed). Nothing it started is left running."""
    opts.from_bundle()
    out = opts.out.resolve()
    _clear_out(out)
    report = Report(out)
    report.facts["engine"] = "cpu" if opts.cpu else "cuda"
    work = Path(tempfile.mkdtemp(prefix="gpu-check-work-"))
    try:
        with procs.Group() as group:
            _pipeline(opts, report, group, work)
    except Exception as exc:  # the report is still written, with what went wrong
        error = report.section("error")
        error.status, error.headline = "fail", f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _finish(report, opts)


def _pipeline(opts: Options, report: Report, group: procs.Group, work: Path) -> None:
    out, engine, source = report.out, report.facts["engine"], Source(opts.source)
    setup = report.section("setup")
    build_section = report.section("build")
    smi_section = report.section("nvidia-smi")
    cases_section = report.section("cases")
    trace_section = report.section("trace")
    report.facts.update(machine_facts())
    setup.lines.append("python packages: " + python_packages(opts.wheels, work))
    setup.lines.append("gguf: " + gguf_package(source, work))
    from lab.gpu_check import cases, smi

    selected = cases.select(opts.cases)
    smi_path = smi.find_smi(opts.nvidia_smi)
    arch = None
    if not opts.cpu:
        if smi_path is None:
            setup.status, setup.headline = "fail", "no nvidia-smi: not a GPU machine (use --cpu)"
            return
        arch = opts.arch or gpu_facts(smi_path, report)
        report.facts["arch"] = f"sm_{arch}"
    server, pending = build_part(opts, group, source, arch, work, out, build_section)
    gpus = nvidia_smi_part(smi_path, out, smi_section)
    spent = cases.write_models(selected, work / "models")
    setup.lines.append(f"models: {len(spent)} written in {sum(spent.values()):.1f} s")
    setup.status, setup.headline = "pass", f"{len(selected)} cases, output in {out}"
    if pending is not None:
        assert arch is not None
        server = finish_build(opts, group, pending, source, arch, out, build_section)
    if server is None:
        return
    records = [cases.run_case(group, server, case, work, out / f"{engine}-truth") for case in selected]
    bad = [r for r in records if r["error"] or not r["truth"]]
    cases_section.status = "fail" if bad else "pass"
    cases_section.headline = f"{len(records) - len(bad)}/{len(records)} recorded in {engine}-truth/"
    cases_section.lines = [cases.buffers_line(r) for r in records]
    trace_part(opts, group, server, selected, work, out, engine, gpus, trace_section)


def _finish(report: Report, opts: Options) -> int:
    report.write()
    archive = pack(report.out)
    text = report.text()
    print(text + f"output: {report.out} and {archive}", flush=True)
    if opts.copy_to is not None:
        opts.copy_to.mkdir(parents=True, exist_ok=True)
        for path in (archive, report.out / "summary.txt", report.out / "summary.json"):
            shutil.copy2(path, opts.copy_to / path.name)
    return 1 if report.failed else 0


def parse_case_list(value: str | None) -> list[str] | None:
    return [name.strip() for name in value.split(",") if name.strip()] if value else None


def main_args(argv: Sequence[str]) -> Options:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lab.gpu_check", description=__doc__)
    parser.add_argument("--cpu", action="store_true", help="the cached CPU engine, no build and no GPU (CI)")
    parser.add_argument("--out", type=Path, default=Path("out/gpu-check"), help="output folder (a .tar.xz beside it)")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--trace-case", help=f"the case traced (default: {DEFAULT_TRACE_CASE} or the first)")
    parser.add_argument("--no-trace", dest="trace", action="store_false")
    parser.add_argument("--bundle", type=Path, help="a folder made by `python -m lab.gpu_check prepare`")
    parser.add_argument("--source", type=Path, help="a slim llama.cpp source tarball (default: the sdist)")
    parser.add_argument("--wheels", type=Path, help="wheels for missing Python packages")
    parser.add_argument("--unit", type=Path, help="a rendered llama_service unit (default: render it with Ansible)")
    parser.add_argument("--syscall-filter", type=Path, help="recorded `systemd-analyze syscall-filter` output")
    parser.add_argument("--nvidia-smi", help="the nvidia-smi to ask (default: on PATH)")
    parser.add_argument("--server", type=Path, help="use this llama-server instead of building one")
    parser.add_argument("--arch", help="CUDA architecture, e.g. 90 (default: the card's compute_cap)")
    parser.add_argument("--strace", help="the strace to use (default: the bundle's, else on PATH)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--copy-to", type=Path, help="also copy the archive and the summary here (the device's $OUT)")
    parser.add_argument("--build-timeout", type=float, default=600.0)
    ns = parser.parse_args(list(argv))
    return Options(out=ns.out, cpu=ns.cpu, cases=parse_case_list(ns.cases), trace_case=ns.trace_case,
                   bundle=ns.bundle, source=ns.source, wheels=ns.wheels, unit=ns.unit,
                   syscall_filter=ns.syscall_filter, nvidia_smi=ns.nvidia_smi, server=ns.server, arch=ns.arch,
                   strace=ns.strace, jobs=ns.jobs, trace=ns.trace, copy_to=ns.copy_to,
                   build_timeout=ns.build_timeout)
