"""Parsers for the Linux system files: /proc/cpuinfo, lscpu, /proc/meminfo, os-release, /proc/version,
``nproc --all`` and ``df -P -k``.

The planner needs physical cores (an offloading MoE wants one thread per core), the AVX2 floor of
the prebuilt binaries (and whether AVX-512 is there), RAM for offloaded experts, and free disk where
the models go. Each parser returns plain values; :mod:`controller.stages.probe.parse` merges them.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from controller.stages.probe.text import Warnings, clean_lines, readable, shorten


@dataclass
class CpuFacts:
    model: str | None = None
    cores: int | None = None
    threads: int | None = None
    flags: list[str] = field(default_factory=list)


def _key_values(text: str, separator: str = ":") -> list[tuple[int, str, str]]:
    pairs = []
    for line in clean_lines(text):
        if separator in line.text:
            key, _, value = line.text.partition(separator)
            pairs.append((line.number, key.strip().lower(), value.strip()))
    return pairs


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def parse_cpuinfo(text: str, warnings: Warnings, file: str = "cpuinfo") -> CpuFacts:
    """Model, physical cores (distinct physical id/core id pairs), threads and flags from /proc/cpuinfo."""
    facts = CpuFacts()
    if not readable(text, warnings, file):
        return facts
    processors = 0
    cores: set[tuple[str, str]] = set()
    physical = core = None
    per_socket: dict[str, int] = {}
    for _number, key, value in _key_values(text):
        if key == "processor":
            processors += 1
            physical = core = None
        elif key in ("model name", "cpu model", "hardware") and facts.model is None and value:
            facts.model = re.sub(r"\s+", " ", value)
        elif key in ("flags", "features") and not facts.flags:
            facts.flags = _unique(value.lower().split())
        elif key == "physical id":
            physical = value
        elif key == "core id":
            core = value
        elif key == "cpu cores" and value.isdigit():
            per_socket[physical or "0"] = int(value)
        if physical is not None and core is not None:
            cores.add((physical, core))
    if processors == 0:
        warnings.add(file, None, "no 'processor' entries found; not a /proc/cpuinfo")
        return facts
    facts.threads = processors
    facts.cores = len(cores) if cores else (sum(per_socket.values()) or None)
    return facts


def parse_lscpu(text: str, warnings: Warnings, file: str = "lscpu.txt") -> CpuFacts:
    """The same facts from ``lscpu`` (C locale); fills what /proc/cpuinfo lacks, e.g. on ARM."""
    facts = CpuFacts()
    if not readable(text, warnings, file):
        return facts
    values = {key: (number, value) for number, key, value in _key_values(text)}
    facts.model = values.get("model name", (0, None))[1] or None
    facts.flags = _unique(values.get("flags", (0, ""))[1].lower().split())
    threads = _int_value(values, "cpu(s)", warnings, file)
    per_core = _int_value(values, "thread(s) per core", warnings, file)
    per_socket = _int_value(values, "core(s) per socket", warnings, file) or _int_value(values, "core(s) per cluster", warnings, file)
    sockets = _int_value(values, "socket(s)", warnings, file) or _int_value(values, "cluster(s)", warnings, file) or 1
    facts.threads = threads
    if per_socket:
        facts.cores = per_socket * sockets
    elif threads and per_core:
        facts.cores = threads // per_core
    if facts.model is None and facts.threads is None:
        warnings.add(file, None, "no 'Model name' or 'CPU(s)' line found; not lscpu output")
    return facts


def _int_value(values: dict[str, tuple[int, str]], key: str, warnings: Warnings, file: str) -> int | None:
    if key not in values:
        return None
    number, value = values[key]
    if value.isdigit():
        return int(value)
    warnings.add(file, number, f"{key} {shorten(value)!r} is not a number")
    return None


def parse_nproc(text: str, warnings: Warnings, file: str = "nproc") -> int | None:
    lines = [line for line in clean_lines(text) if line.text.strip()]
    if not lines:
        return None
    value = lines[0].text.strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    warnings.add(file, lines[0].number, f"{shorten(value)!r} is not a processor count")
    return None


def parse_meminfo(text: str, warnings: Warnings, file: str = "meminfo") -> int | None:
    """MemTotal in MiB."""
    if not readable(text, warnings, file):
        return None
    for number, key, value in _key_values(text):
        if key == "memtotal":
            match = re.fullmatch(r"(\d+)\s*(kB|KiB)?", value, re.IGNORECASE)
            if match:
                return int(match.group(1)) // 1024
            warnings.add(file, number, f"MemTotal {shorten(value)!r} is not a size in kB")
            return None
    warnings.add(file, None, "no MemTotal line found")
    return None


@dataclass
class OsRelease:
    name: str | None = None
    version: str | None = None
    id: str | None = None


def parse_os_release(text: str, warnings: Warnings, file: str = "os-release") -> OsRelease:
    """NAME and VERSION_ID (falling back to VERSION, then PRETTY_NAME) from /etc/os-release."""
    release = OsRelease()
    if not readable(text, warnings, file):
        return release
    values: dict[str, str] = {}
    for line in clean_lines(text):
        stripped = line.text.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key, sep, raw = stripped.partition("=")
        if not sep or not re.fullmatch(r"[A-Z0-9_]+", key):
            warnings.add(file, line.number, f"not a KEY=value line: {shorten(stripped)!r}")
            continue
        values[key] = _unquote(raw)
    release.name = values.get("NAME") or values.get("PRETTY_NAME")
    release.version = values.get("VERSION_ID") or values.get("VERSION")
    release.id = values.get("ID")
    return release


def _unquote(raw: str) -> str:
    try:
        parts = shlex.split(raw, posix=True)
    except ValueError:
        return raw.strip().strip("\"'")
    return " ".join(parts)


def is_wsl_kernel(text: str) -> bool:
    """/proc/version of a WSL kernel names Microsoft (WSL2: ``...-microsoft-standard-WSL2``)."""
    return "microsoft" in text.lower() or "wsl" in text.lower()


@dataclass
class DfRow:
    line: int
    filesystem: str
    total_mib: int
    free_mib: int
    mount: str


def parse_df(text: str, warnings: Warnings, file: str = "df.txt") -> list[DfRow]:
    """Rows of ``df -P -k PATH``: POSIX format, one line per filesystem, sizes in 1024-byte blocks."""
    rows: list[DfRow] = []
    if not readable(text, warnings, file):
        return rows
    lines = [line for line in clean_lines(text) if line.text.strip()]
    block = 1024
    for line in lines:
        fields = line.text.split()
        if fields[0].lower() == "filesystem":
            size = re.match(r"(\d+)-blocks", fields[1]) if len(fields) > 1 else None
            block = int(size.group(1)) if size else block
            continue
        row = _df_row(fields, block, line.number)
        if row is None:
            warnings.add(file, line.number, f"not a df -P row: {shorten(line.text)!r}")
            continue
        rows.append(row)
    return rows


def _df_row(fields: list[str], block: int, number: int) -> DfRow | None:
    # Filesystem, blocks, used, available, capacity, mount point (which may contain spaces).
    if len(fields) < 6 or not (fields[1].isdigit() and fields[3].isdigit()) or not fields[4].endswith("%"):
        return None
    return DfRow(number, fields[0], int(fields[1]) * block // 2**20, int(fields[3]) * block // 2**20,
                 " ".join(fields[5:]))
