"""Parsers for ``nvidia-smi --query-gpu ... --format=csv``, the default ``nvidia-smi`` table and ``nvidia-smi -q``.

Both produce :class:`SmiReading`: per-GPU fields keyed by the nvidia-smi index plus the driver facts.
The CSV is preferred because it is meant for machines; the table is what people paste and what a box
with an old driver (no ``compute_cap`` field) still prints, so both must work alone.

The table has had three layouts that matter here (before R530, R535–R545, R555 and later), and on
Windows the ``Persistence-M`` column is ``Driver-Model`` (``TCC/WDDM`` before R555). They differ in
column widths and wording, not in structure, so the table is read cell by cell between the ``|``
separators instead of by character positions.

``nvidia-smi -q`` is read for one thing the other two never print: each card's device minor number
(``/dev/nvidia<minor>``), which ``--query-gpu`` has no field for on every driver.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field

from controller.stages.probe.text import Line, Warnings, clean_lines, is_placeholder, looks_binary, shorten

QUERY_FIELDS = (
    "index", "uuid", "name", "serial", "pci.bus_id", "memory.total", "compute_cap",
    "driver_version", "driver_model.current", "power.limit", "temperature.gpu",
)
"""The fields of the ``--query-gpu`` call in the probe contract, in the order the probe asks for them."""

DRIVER_MODELS = ("TCC", "WDDM", "MCDM")

_COLUMN_ALIASES = {
    "index": "index",
    "uuid": "uuid", "gpu_uuid": "uuid",
    "name": "name", "gpu_name": "name",
    "serial": "serial", "gpu_serial": "serial",
    "pci.bus_id": "pci_bus_id", "gpu_bus_id": "pci_bus_id",
    "memory.total": "memory_mib",
    "compute_cap": "compute_capability",
    "driver_version": "driver_version",
    "driver_model.current": "driver_model",
    "power.limit": "power_limit_w",
    "temperature.gpu": "temperature_c",
    "timestamp": "timestamp",
}

_UNIT_FACTORS_MIB = {"": 1.0, "mib": 1.0, "mb": 1.0, "gib": 1024.0, "gb": 1024.0, "kib": 1 / 1024}

_NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([A-Za-z%]*)\s*$")
_BUS_ID = re.compile(r"\b([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\b")


@dataclass
class GpuFields:
    """What one source said about one GPU; ``None`` where it said nothing usable."""

    index: int
    line: int | None = None
    name: str | None = None
    uuid: str | None = None
    serial: str | None = None
    pci_bus_id: str | None = None
    memory_mib: int | None = None
    compute_capability: str | None = None
    power_limit_w: float | None = None
    temperature_c: float | None = None
    driver_model: str | None = None


@dataclass
class SmiReading:
    gpus: dict[int, GpuFields] = field(default_factory=dict)
    driver_version: str | None = None
    driver_line: int | None = None
    smi_version: str | None = None
    cuda_version: str | None = None
    windows_layout: bool = False  # the table had a Driver-Model column: only nvidia-smi.exe prints one
    no_devices: bool = False


# --------------------------------------------------------------------------------------------- CSV


def _header_name(cell: str) -> str:
    """``memory.total [MiB]`` -> ``memory.total``: units in the header are dropped, values carry them."""
    return re.sub(r"\s*\[[^\]]*\]\s*$", "", cell.strip()).strip().lower()


def _header_unit(cell: str) -> str:
    match = re.search(r"\[([^\]]*)\]\s*$", cell)
    return match.group(1).strip().lower() if match else ""


def _number(value: str) -> tuple[float, str] | None:
    match = _NUMBER.match(value)
    if not match:
        return None
    return float(match.group(1)), match.group(2).lower()


def _mib(value: str, header_unit: str) -> int | None:
    parsed = _number(value)
    if parsed is None:
        return None
    amount, unit = parsed
    factor = _UNIT_FACTORS_MIB.get(unit or header_unit)
    return None if factor is None else round(amount * factor)


def _float(value: str) -> float | None:
    parsed = _number(value)
    return None if parsed is None else parsed[0]


def _compute_capability(value: str) -> str | None:
    match = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", value)
    return f"{int(match.group(1))}.{int(match.group(2))}" if match else None


def parse_query_csv(text: str, warnings: Warnings, file: str = "nvidia-smi-query.csv") -> SmiReading:
    """Read the CSV of ``nvidia-smi --query-gpu=... --format=csv`` with any column order or subset."""
    reading = SmiReading()
    if looks_binary(text):
        warnings.add(file, None, "is not text (binary data); ignored")
        return reading
    lines = [line for line in clean_lines(text) if line.text.strip()]
    if not lines:
        return reading
    start = next((i for i, line in enumerate(lines) if any(_csv_columns(line.text)[0])), None)
    if start is None:
        first = next(csv.reader([lines[0].text], skipinitialspace=True))
        reason = "no header row (use --format=csv, not noheader)" if first and _NUMBER.match(first[0]) else (
            f"not a --query-gpu CSV header: {shorten(lines[0].text)!r}")
        warnings.add(file, lines[0].number, reason)
        return reading
    for line in lines[:start]:
        warnings.add(file, line.number, f"text before the CSV header ignored: {shorten(line.text)!r}")
    columns, units = _csv_columns(lines[start].text)
    _read_csv_rows(lines[start + 1:], columns, units, reading, warnings, file)
    return reading


def _csv_columns(text: str) -> tuple[list[str | None], list[str]]:
    header = next(csv.reader([text], skipinitialspace=True), [])
    return [_COLUMN_ALIASES.get(_header_name(cell)) for cell in header], [_header_unit(cell) for cell in header]


def _read_csv_rows(rows: list[Line], columns: list[str | None], units: list[str], reading: SmiReading,
                   warnings: Warnings, file: str) -> None:
    identity = next((key for key in ("index", "uuid", "pci_bus_id", "serial") if key in columns), None)
    seen: set[str] = set()
    for position, line in enumerate(rows):
        cells = next(csv.reader([line.text], skipinitialspace=True))
        if len(cells) != len(columns):
            warnings.add(file, line.number,
                         f"row has {len(cells)} fields, header has {len(columns)}; read the fields that line up")
        values = {col: cell.strip() for col, cell in zip(columns, cells) if col is not None}
        if identity is None and "timestamp" in values and position > 0:
            warnings.add(file, line.number,
                         "repeated samples without an index column; kept the first sample as one GPU")
            break
        key = values.get(identity) if identity else None
        if key is not None and key in seen:
            warnings.add(file, line.number, "repeated readings of the same GPUs (nvidia-smi -l); kept the first")
            break
        if key is not None:
            seen.add(key)
        _csv_row_to_gpu(values, units, columns, position, line, reading, warnings, file)


def _csv_row_to_gpu(values: dict[str, str], units: list[str], columns: list[str | None], position: int,
                    line: Line, reading: SmiReading, warnings: Warnings, file: str) -> None:
    index = position
    if "index" in values:
        try:
            index = int(values["index"])
        except ValueError:
            warnings.add(file, line.number, f"index {shorten(values['index'])!r} is not a number; used the row position {position}")
    if index in reading.gpus:
        warnings.add(file, line.number, f"GPU index {index} appears twice; kept the first row")
        return
    gpu = GpuFields(index=index, line=line.number)
    unit_of = {col: unit for col, unit in zip(columns, units) if col is not None}
    for column, value in values.items():
        if is_placeholder(value):
            continue
        _set_csv_field(gpu, column, value, unit_of.get(column, ""), reading, line, warnings, file)
    reading.gpus[index] = gpu


def _set_csv_field(gpu: GpuFields, column: str, value: str, unit: str, reading: SmiReading, line: Line,
                   warnings: Warnings, file: str) -> None:
    if column in ("name", "uuid", "serial"):
        setattr(gpu, column, value)
    elif column == "pci_bus_id":
        gpu.pci_bus_id = value
    elif column == "memory_mib":
        gpu.memory_mib = _mib(value, unit)
        if gpu.memory_mib is None:
            warnings.add(file, line.number, f"memory.total {shorten(value)!r} is not a size")
    elif column == "compute_capability":
        gpu.compute_capability = _compute_capability(value)
        if gpu.compute_capability is None:
            warnings.add(file, line.number, f"compute_cap {shorten(value)!r} is not of the form 7.0")
    elif column in ("power_limit_w", "temperature_c"):
        setattr(gpu, column, _float(value))
    elif column == "driver_model":
        model = value.upper()
        gpu.driver_model = model if model in DRIVER_MODELS else None
    elif column == "driver_version":
        if reading.driver_version is None:
            reading.driver_version, reading.driver_line = value, line.number
        elif reading.driver_version != value:
            warnings.add(file, line.number, f"driver_version {value} differs from {reading.driver_version} on an earlier row")


# ------------------------------------------------------------------------------------------- table

_SMI_HEADER = re.compile(
    r"NVIDIA-SMI\s+(?P<smi>\S+)\s+Driver Version:\s*(?P<driver>\S+)(?:\s+CUDA Version:\s*(?P<cuda>[^\s|]+))?",
    re.IGNORECASE,
)
_GPU_FIRST_CELL = re.compile(r"^\s*(?P<index>\d+)\s+(?P<name>.*?\S)\s+(?P<mode>On|Off|TCC|WDDM|MCDM|N/A|ERR!)\s*$")
_DATE_LINE = re.compile(r"^\s*\w{3}\s+\w{3}\s+\d{1,2}\s+\d{1,2}:\d{2}:\d{2}\s+\d{4}\s*$")
_MEMORY = re.compile(r"(\d+)\s*MiB\s*/\s*(\d+)\s*MiB")
_TEMPERATURE = re.compile(r"\b(\d+)C\b")
_POWER_CAP = re.compile(r"/\s*(\d+(?:\.\d+)?)\s*W\b")
_STOP = re.compile(r"^\|?\s*(Processes:|MIG devices:)", re.IGNORECASE)

_MESSAGES = (
    ("no devices were found", "nvidia-smi found no GPUs"),
    ("unable to determine the device handle", "nvidia-smi could not reach a GPU (fallen off the bus?)"),
    ("couldn't communicate with the nvidia driver", "the NVIDIA driver is not loaded (nvidia-smi could not talk to it)"),
    ("failed to initialize nvml", "nvidia-smi could not initialise NVML: the driver is missing or mismatched"),
)


def parse_table(text: str, warnings: Warnings, file: str = "nvidia-smi.txt") -> SmiReading:
    """Read the default ``nvidia-smi`` table (any of its layouts, Linux or Windows)."""
    reading = SmiReading()
    if looks_binary(text):
        warnings.add(file, None, "is not text (binary data); ignored")
        return reading
    lines = clean_lines(text)
    if not any(line.text.strip() for line in lines):
        return reading
    state = _TableState()
    for line in lines:
        if state.stopped:
            break
        _table_line(line, reading, state, warnings, file)
    _finish_block(state, reading, warnings, file, at_end=True)
    if reading.driver_version is None and not reading.gpus and not reading.no_devices and not state.reported:
        warnings.add(file, None, "no nvidia-smi table found in it")
    return reading


@dataclass
class _TableState:
    in_gpus: bool = False
    stopped: bool = False
    current: GpuFields | None = None
    has_memory_line: bool = False
    reported: bool = False  # a message from nvidia-smi itself was turned into a warning


def _table_line(line: Line, reading: SmiReading, state: _TableState, warnings: Warnings, file: str) -> None:
    text = line.text
    stripped = text.strip()
    if not stripped or set(stripped) <= set("+-=| "):
        if stripped.startswith(("|=", "+=")) or "=|=" in stripped or "=+=" in stripped:
            state.in_gpus = True
        return
    header = _SMI_HEADER.search(text)
    if header:
        reading.smi_version = header.group("smi")
        reading.driver_version, reading.driver_line = header.group("driver"), line.number
        cuda = header.group("cuda")
        reading.cuda_version = None if cuda is None or is_placeholder(cuda) else cuda
        return
    if "Driver-Model" in text or "TCC/WDDM" in text:
        reading.windows_layout = True
        return
    if _STOP.match(stripped):
        _finish_block(state, reading, warnings, file, at_end=False)
        state.stopped = True
        return
    if not stripped.startswith("|"):
        _outside_table(line, reading, state, warnings, file)
        return
    if state.in_gpus:
        _gpu_line(line, reading, state, warnings, file)


def _outside_table(line: Line, reading: SmiReading, state: _TableState, warnings: Warnings, file: str) -> None:
    lowered = line.text.lower()
    if _DATE_LINE.match(line.text):
        return
    for needle, message in _MESSAGES:
        if needle in lowered:
            reading.no_devices = reading.no_devices or needle == "no devices were found"
            warnings.add(file, line.number, f"{message}: {shorten(line.text, 90)!r}")
            state.reported = True
            return
    warnings.add(file, line.number, f"text outside the table ignored: {shorten(line.text)!r}")
    state.reported = True


def _cells(text: str) -> list[str]:
    parts = text.strip().split("|")
    if parts and parts[0] == "":
        parts = parts[1:]
    if parts and parts[-1].strip() == "":
        parts = parts[:-1]
    return parts


def _gpu_line(line: Line, reading: SmiReading, state: _TableState, warnings: Warnings, file: str) -> None:
    cells = _cells(line.text)
    first = _GPU_FIRST_CELL.match(cells[0]) if cells else None
    if first and not _MEMORY.search(line.text):
        _finish_block(state, reading, warnings, file, at_end=False)
        index = int(first.group("index"))
        gpu = GpuFields(index=index, line=line.number, name=first.group("name").strip())
        mode = first.group("mode").upper()
        if mode in DRIVER_MODELS:
            gpu.driver_model = mode
            reading.windows_layout = True
        bus = _BUS_ID.search(cells[1]) if len(cells) > 1 else None
        gpu.pci_bus_id = bus.group(1) if bus else None
        if bus is None:
            warnings.add(file, line.number, f"GPU {index} row has no PCI bus id")
        if index in reading.gpus:
            warnings.add(file, line.number, f"GPU index {index} appears twice; kept the first")
            state.current = None
            return
        reading.gpus[index] = gpu
        state.current, state.has_memory_line = gpu, False
        return
    memory = _MEMORY.search(line.text)
    if memory and state.current is not None and not state.has_memory_line:
        _read_usage_line(line.text, memory, state.current)
        state.has_memory_line = True
        return
    if memory and state.current is None:
        warnings.add(file, line.number, "a usage line with no GPU row before it; ignored")
        return
    if cells and re.match(r"^\s*\d+\s", cells[0]) and not memory:
        warnings.add(file, line.number, f"GPU row not understood: {shorten(line.text)!r}")


def _read_usage_line(text: str, memory: re.Match[str], gpu: GpuFields) -> None:
    gpu.memory_mib = int(memory.group(2))
    first_cell = _cells(text)[0] if _cells(text) else ""
    temperature = _TEMPERATURE.search(first_cell)
    gpu.temperature_c = float(temperature.group(1)) if temperature else None
    cap = _POWER_CAP.search(first_cell)
    gpu.power_limit_w = float(cap.group(1)) if cap else None


def _finish_block(state: _TableState, reading: SmiReading, warnings: Warnings, file: str, *, at_end: bool) -> None:
    gpu = state.current
    if gpu is not None and not state.has_memory_line:
        where = "the table ends" if at_end else "the next row starts"
        warnings.add(file, gpu.line, f"{where} before GPU {gpu.index}'s usage line (output cut short?); its memory is unknown")
    state.current, state.has_memory_line = None, False


# -------------------------------------------------------------------------------------------- -q

MAX_CARD_MINOR = 253  # 254 and 255 are the driver's own nodes (nvidia-modeset, nvidiactl)
_Q_GPU = re.compile(r"^GPU\s+(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$")
_Q_FIELD = re.compile(r"^\s+(?P<key>[^:]*?\S)\s*:\s*(?P<value>.*?)\s*$")


@dataclass
class QueryGpu:
    """One ``GPU <bus id>`` section of ``nvidia-smi -q``: what it says about the card's identity."""

    pci_bus_id: str
    line: int
    uuid: str | None = None
    minor_number: int | None = None


def parse_smi_q(text: str, warnings: Warnings, file: str = "nvidia-smi-q.txt") -> list[QueryGpu]:
    """Read each card's UUID and minor number from ``nvidia-smi -q`` (sections ``GPU <bus id>``, in index order).

    Only the fields directly under a section's header count (``GPU UUID``, ``Minor Number``): deeper ones such as
    ``ClusterUUID`` belong to sub-sections. Windows prints ``Minor Number : N/A``: no device node, no number.
    """
    if looks_binary(text):
        warnings.add(file, None, "is not text (binary data); ignored")
        return []
    lines = clean_lines(text)
    found: list[QueryGpu] = []
    current: QueryGpu | None = None
    for line in lines:
        header = _Q_GPU.match(line.text)
        if header:
            current = QueryGpu(pci_bus_id=header.group("bus"), line=line.number)
            found.append(current)
            continue
        field_match = _Q_FIELD.match(line.text)
        if current is None or field_match is None or len(line.text) - len(line.text.lstrip(" ")) != 4:
            continue
        key, value = field_match.group("key"), field_match.group("value")
        if key == "GPU UUID" and not is_placeholder(value):
            current.uuid = value
        elif key == "Minor Number" and not is_placeholder(value):
            if value.isdigit() and int(value) <= MAX_CARD_MINOR:
                current.minor_number = int(value)
            else:
                warnings.add(file, line.number, f"Minor Number {shorten(value)!r} of the GPU at {current.pci_bus_id} "
                             f"is not a card's device minor number (0 to {MAX_CARD_MINOR}); its device node is unknown")
    if not found and any(line.text.strip() for line in lines):
        lowered = text.lower()
        if not any(needle in lowered for needle, _ in _MESSAGES):  # nvidia-smi.txt reports those already
            warnings.add(file, None, "no GPU section found in it (expected lines 'GPU 00000000:04:00.0' of nvidia-smi -q)")
    return found
