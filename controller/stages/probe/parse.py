"""Turn the captured outputs of a probe into a :class:`~controller.model.profile.HardwareProfile`.

One entry point, :func:`parse_outputs`, takes the outputs by file name (the ``--from-dir`` contract)
whether they came from a folder, an SSH round trip or WinRM. Any output may be missing, empty or
garbage: the profile is built from what is there, and every problem becomes a warning that names
the file and line, never an exception, because a half-read box is still worth reporting and the
operator needs to know which line to look at.

Where two outputs say the same thing, the one meant for machines wins: the ``--query-gpu`` CSV over
the table, /proc/cpuinfo over lscpu, the topo matrix over guesses from ``nvlink -s``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError

from controller.errors import ProbeError
from controller.model.profile import Cpu, Disk, Driver, Gpu, HardwareProfile, NvLink, OsInfo
from controller.stages.probe.commands import LINUX_PROBE_COMMANDS, WINDOWS_PROBE_COMMANDS
from controller.stages.probe.driver import driver_window_problem
from controller.stages.probe.gpu_models import known_compute_capability
from controller.stages.probe.lspci import PciGpu, parse_lspci, pci_gpu
from controller.stages.probe.nvidia_smi import (
    GpuFields,
    QueryGpu,
    SmiReading,
    parse_query_csv,
    parse_smi_q,
    parse_table,
)
from controller.stages.probe.system import (
    CpuFacts,
    DfRow,
    OsRelease,
    is_wsl_kernel,
    parse_cpuinfo,
    parse_df,
    parse_lscpu,
    parse_meminfo,
    parse_nproc,
    parse_os_release,
)
from controller.stages.probe.text import Warnings, clean_lines, looks_binary
from controller.stages.probe.topo import NvlinkGpu, Topology, boards, parse_nvlink_status, parse_topo
from controller.stages.probe.windows import WindowsFacts, parse_windows_cim

QUERY_CSV = "nvidia-smi-query.csv"
SMI_TABLE = "nvidia-smi.txt"
SMI_Q = "nvidia-smi-q.txt"
TOPO = "nvidia-smi-topo.txt"
NVLINK = "nvidia-smi-nvlink.txt"
CPUINFO = "cpuinfo"
MEMINFO = "meminfo"
OS_RELEASE = "os-release"
LSCPU = "lscpu.txt"
DF = "df.txt"
WINDOWS_CIM = "windows-cim.json"
PROC_VERSION = "proc-version"
NPROC = "nproc"
LSPCI = "lspci.txt"

PROBE_FILES = (QUERY_CSV, SMI_TABLE, TOPO, NVLINK, CPUINFO, MEMINFO, OS_RELEASE, LSCPU, DF, WINDOWS_CIM,
               PROC_VERSION, NPROC, LSPCI, SMI_Q)
"""Every output name :func:`parse_outputs` understands (the issue's contract plus proc-version, nproc,
lspci.txt and nvidia-smi-q.txt)."""

__all__ = ["LINUX_PROBE_COMMANDS", "PROBE_FILES", "WINDOWS_PROBE_COMMANDS", "parse_outputs", "read_dir"]

_T = TypeVar("_T")


# ------------------------------------------------------------------------------------ reading a dir


def _decode(data: bytes) -> str:
    """UTF-8, or UTF-16 with a BOM (what Windows PowerShell 5.1 ``>`` writes); never fails."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return data.decode("utf-16", errors="replace")
    return data.decode("utf-8", errors="replace").lstrip("\ufeff")


def read_dir(path: str | Path) -> dict[str, str]:
    """Read the probe outputs found in ``path`` (missing files are simply absent from the result).

    A file without an extension may also be saved with ``.txt`` (``cpuinfo.txt``), as people do.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ProbeError(f"{folder}: not a folder; give the folder that holds nvidia-smi.txt, cpuinfo, ...")
    outputs: dict[str, str] = {}
    for name in PROBE_FILES:
        candidates = [folder / name] + ([folder / f"{name}.txt"] if "." not in name else [])
        file = next((candidate for candidate in candidates if candidate.is_file()), None)
        if file is None:
            continue
        try:
            outputs[name] = _decode(file.read_bytes())
        except OSError as exc:
            raise ProbeError(f"{file}: cannot read it ({exc.strerror}); fix its permissions or remove it") from None
    return outputs


# ----------------------------------------------------------------------------------------- parsing


def _as_text(outputs: Mapping[str, str | bytes | None]) -> dict[str, str]:
    """Transports may hand over bytes, or None for a command that printed nothing."""
    texts: dict[str, str] = {}
    for name, value in outputs.items():
        if isinstance(value, bytes):
            texts[name] = _decode(value)
        elif isinstance(value, str):
            texts[name] = value
    return texts


def _guarded(outputs: Mapping[str, str], name: str, parser: Callable[[str, Warnings, str], _T],
             default: Callable[[], _T], warnings: Warnings) -> _T:
    """Run one file's parser; a parser bug on odd input costs that file, never the whole probe."""
    text = outputs.get(name)
    if text is None:
        return default()
    try:
        return parser(text, warnings, name)
    except Exception as exc:  # noqa: BLE001 - the contract is "warn and keep going", whatever the input
        warnings.add(name, None, f"could not be parsed ({type(exc).__name__}: {exc}); ignored")
        return default()


def parse_outputs(outputs: Mapping[str, str], *, model_dir: str | None = None) -> HardwareProfile:
    """Build the hardware profile from probe outputs keyed by file name (see :data:`PROBE_FILES`).

    ``model_dir`` is where the models will live; the disk entry for it carries that path. A value no box can
    have (a negative memory size, an absurd GPU index) is one line naming it, never a crash.
    """
    try:
        return _parse_outputs(outputs, model_dir=model_dir)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the profile"
        raise ProbeError(f"the probe outputs give {where} = {first.get('input')!r}, which no box has "
                         f"({first['msg']}); check the captured outputs or the box's nvidia-smi") from None


def _parse_outputs(outputs: Mapping[str, str], *, model_dir: str | None = None) -> HardwareProfile:
    warnings = Warnings()
    outputs = _as_text(outputs)
    for name in outputs:
        if name not in PROBE_FILES:
            warnings.add(name, None, "not a probe output this parser knows; ignored")
    csv_reading = _guarded(outputs, QUERY_CSV, parse_query_csv, SmiReading, warnings)
    table = _guarded(outputs, SMI_TABLE, parse_table, SmiReading, warnings)
    topology = _guarded(outputs, TOPO, parse_topo, Topology, warnings)
    nvlink = _guarded(outputs, NVLINK, parse_nvlink_status, dict, warnings)
    windows = _guarded(outputs, WINDOWS_CIM, parse_windows_cim, WindowsFacts, warnings)

    os_info = _os_info(outputs, table, csv_reading, windows, warnings)
    gpus = _gpus(csv_reading, table, nvlink, warnings)
    _identify(gpus, _guarded(outputs, SMI_Q, parse_smi_q, list, warnings), warnings)
    on_bus = _guarded(outputs, LSPCI, parse_lspci, list, warnings)
    if not gpus:
        on_bus = on_bus or [pci_gpu(None, device, name) for device, name in windows.nvidia_pci]
        gpus = _pci_gpus(on_bus, LSPCI if on_bus and on_bus[0].pci_bus_id else WINDOWS_CIM, warnings)
    driver = _driver(csv_reading, table, gpus, os_info, warnings)
    pairs = _pairs(topology, nvlink, gpus, warnings)
    indices = [gpu.index for gpu in gpus] if gpus else topology.gpus
    return HardwareProfile(
        gpus=gpus,
        driver=driver,
        nvlink=NvLink(pairs=pairs),
        boards=boards(indices, pairs),
        cpu=_cpu(outputs, windows, warnings),
        memory_mib=_guarded(outputs, MEMINFO, parse_meminfo, lambda: None, warnings) or windows.memory_mib,
        os=os_info,
        disks=_disks(outputs, windows, model_dir, warnings),
        warnings=warnings.items,
    )


# --------------------------------------------------------------------------------------------- GPUs


def _gpus(csv_reading: SmiReading, table: SmiReading, nvlink: dict[int, NvlinkGpu], warnings: Warnings) -> list[Gpu]:
    if csv_reading.gpus and table.gpus and set(csv_reading.gpus) != set(table.gpus):
        only = [(sorted(set(csv_reading.gpus) - set(table.gpus)), QUERY_CSV),
                (sorted(set(table.gpus) - set(csv_reading.gpus)), SMI_TABLE)]
        listing = "; ".join(f"GPU {', '.join(map(str, indices))} only in {file}" for indices, file in only if indices)
        warnings.add(QUERY_CSV, None, f"the GPUs differ from {SMI_TABLE} ({listing}); a GPU may have dropped off "
                     "the bus between the two commands")
    indices = sorted(set(csv_reading.gpus) | set(table.gpus))
    if not indices and nvlink:
        indices = sorted(index for index, gpu in nvlink.items() if gpu.name)
    gpus = [_gpu(index, csv_reading.gpus.get(index), table.gpus.get(index), nvlink.get(index), warnings)
            for index in indices]
    cut = [gpu for gpu in gpus if gpu.name.endswith("...")]
    if cut:
        first = table.gpus.get(cut[0].index)
        warnings.add(SMI_TABLE, first.line if first else None,
                     f"names cut short by the table (GPU {', '.join(str(gpu.index) for gpu in cut)}: "
                     f"{cut[0].name!r}); {QUERY_CSV} gives full names")
    return gpus


def _identify(gpus: list[Gpu], sections: list[QueryGpu], warnings: Warnings) -> None:
    """Give each GPU its device minor number (and its UUID where the CSV had none) from ``nvidia-smi -q``.

    A section belongs to the GPU at its PCI bus id, else to the GPU with its UUID. Two cards claiming one
    minor number would share a device node: neither keeps it.
    """
    if not sections or not gpus:
        return
    claimed: dict[int, QueryGpu] = {}
    for gpu in gpus:
        section = next((s for s in sections if gpu.pci_bus_id and _bus(s.pci_bus_id) == _bus(gpu.pci_bus_id)), None)
        section = section or next((s for s in sections if gpu.uuid and s.uuid == gpu.uuid), None)
        if section is None:
            warnings.add(SMI_Q, None, f"has no section for GPU {gpu.index} ({gpu.pci_bus_id or gpu.uuid or gpu.name}); "
                         "its device minor number is unknown")
            continue
        claimed[id(section)] = section
        if gpu.uuid and section.uuid and gpu.uuid != section.uuid:
            warnings.add(SMI_Q, section.line, f"GPU {gpu.index} at {gpu.pci_bus_id} has UUID {section.uuid} here but "
                         f"{gpu.uuid} in {QUERY_CSV}; the cards changed between the two commands")
            continue
        gpu.uuid = gpu.uuid or section.uuid
        gpu.minor_number = section.minor_number
    for section in sections:
        if id(section) not in claimed:
            warnings.add(SMI_Q, section.line, f"the GPU at {section.pci_bus_id} is not among the GPUs nvidia-smi lists; "
                         "ignored")
    minors = [gpu.minor_number for gpu in gpus if gpu.minor_number is not None]
    for minor in sorted({minor for minor in minors if minors.count(minor) > 1}):
        sharing = [gpu for gpu in gpus if gpu.minor_number == minor]
        warnings.add(SMI_Q, None, f"GPUs {', '.join(str(gpu.index) for gpu in sharing)} all give minor number {minor}; "
                     "a device node belongs to one card, so none of them keeps it")
        for gpu in sharing:
            gpu.minor_number = None


def _pci_gpus(found: list[PciGpu], source: str, warnings: Warnings) -> list[Gpu]:
    """GPUs from the PCI bus when nvidia-smi saw none: the driver is missing or not loaded."""
    if not found:
        return []
    warnings.add(source, found[0].line or None, f"{len(found)} NVIDIA GPU(s) on the PCI bus but nvidia-smi lists none: no "
                 "driver is loaded; names and memory come from the PCI device ids, NVLink is unknown until the "
                 "driver is installed")
    return [Gpu(index=index, name=gpu.name, memory_mib=gpu.memory_mib, pci_bus_id=gpu.pci_bus_id,
                compute_capability=known_compute_capability(gpu.name)) for index, gpu in enumerate(found)]


def _pick(attribute: str, *sources: object) -> object:
    for source in sources:
        value = getattr(source, attribute, None) if source is not None else None
        if value is not None:
            return value
    return None


def _gpu(index: int, from_csv: GpuFields | None, from_table: GpuFields | None, from_nvlink: NvlinkGpu | None,
         warnings: Warnings) -> Gpu:
    sources = (from_csv, from_table)
    name = _pick("name", from_csv, from_table, from_nvlink)
    origin, line = ((QUERY_CSV, from_csv.line) if from_csv else (SMI_TABLE, from_table.line) if from_table
                    else (NVLINK, from_nvlink.line if from_nvlink else None))
    if name is None:
        warnings.add(origin, line, f"GPU {index} has no name; listed as 'Unknown GPU'")
        name = "Unknown GPU"
    capability = _pick("compute_capability", *sources) or known_compute_capability(str(name))
    if capability is None:
        warnings.add(origin, line, f"GPU {index} ({name}) is not a GPU model this probe knows; its compute "
                     "capability is unknown and the planner will not use it")
    pci_csv, pci_table = _pick("pci_bus_id", from_csv), _pick("pci_bus_id", from_table)
    if pci_csv and pci_table and _bus(str(pci_csv)) != _bus(str(pci_table)):
        warnings.add(SMI_TABLE, from_table.line if from_table else None,
                     f"GPU {index} is at {pci_table} here but at {pci_csv} in {QUERY_CSV}; the GPU order changed")
    return Gpu(
        index=index,
        uuid=_pick("uuid", *sources, from_nvlink),
        name=str(name),
        memory_mib=_pick("memory_mib", *sources),
        compute_capability=capability,
        pci_bus_id=pci_csv or pci_table,
        serial=_pick("serial", *sources),
        power_limit_w=_pick("power_limit_w", *sources),
        temperature_c=_pick("temperature_c", *sources),
    )


def _bus(bus_id: str) -> str:
    """``00000000:04:00.0`` and ``0000:04:00.0`` name the same device."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    try:
        return f"{int(domain, 16):x}:{rest}"
    except ValueError:
        return bus_id.strip().lower()


# ------------------------------------------------------------------------------------------- driver


def _driver(csv_reading: SmiReading, table: SmiReading, gpus: list[Gpu], os_info: OsInfo,
            warnings: Warnings) -> Driver:
    version = csv_reading.driver_version or table.driver_version
    source, line = (QUERY_CSV, csv_reading.driver_line) if csv_reading.driver_version else (SMI_TABLE, table.driver_line)
    if csv_reading.driver_version and table.driver_version and csv_reading.driver_version != table.driver_version:
        warnings.add(SMI_TABLE, table.driver_line, f"driver {table.driver_version} differs from "
                     f"{csv_reading.driver_version} in {QUERY_CSV}; the driver changed between the two")
    model = _driver_model(csv_reading, table, gpus, os_info, warnings)
    if version:
        problem = driver_window_problem(version, has_volta=any(gpu.is_v100 for gpu in gpus),
                                        os_family=os_info.family, wsl=os_info.wsl)
        if problem:
            warnings.add(source, line, problem)
    return Driver(version=version, cuda_version=table.cuda_version, model=model)


def _driver_model(csv_reading: SmiReading, table: SmiReading, gpus: list[Gpu], os_info: OsInfo,
                  warnings: Warnings) -> str | None:
    modes: dict[int, str] = {}
    for reading in (table, csv_reading):  # CSV last so it wins
        modes.update({index: gpu.driver_model for index, gpu in reading.gpus.items() if gpu.driver_model})
    if not modes:
        return None
    volta = [gpu.index for gpu in gpus if gpu.is_v100 and gpu.index in modes]
    if len(set(modes.values())) > 1:
        listing = ", ".join(f"GPU {index} {mode}" for index, mode in sorted(modes.items()))
        warnings.add(SMI_TABLE if table.gpus else QUERY_CSV, None,
                     f"GPUs run in different driver models ({listing}); reported the first V100's")
    for index in volta:
        if modes[index] != "TCC" and os_info.family == "windows" and not os_info.wsl:
            warnings.add(SMI_TABLE if table.gpus else QUERY_CSV, None,
                         f"GPU {index} is in {modes[index]} mode; native Windows serving wants TCC (much faster "
                         f"decode): run 'nvidia-smi -i {index} -dm 1' as administrator and reboot")
    chosen = volta[0] if volta else min(modes)
    return modes[chosen]


# ------------------------------------------------------------------------------------------- NVLink


def _pairs(topology: Topology, nvlink: dict[int, NvlinkGpu], gpus: list[Gpu],
           warnings: Warnings) -> list[tuple[int, int, int]]:
    pairs = [(i, j, count) for (i, j), count in sorted(topology.links.items())]
    linked = sorted(index for index, gpu in nvlink.items() if gpu.active_links)
    if not topology.links and len(linked) == 2 and not topology.gpus:
        i, j = linked
        pairs = [(i, j, min(nvlink[i].active_links, nvlink[j].active_links))]  # two linked GPUs: each other's peer
    elif not topology.gpus and len(linked) > 2:
        warnings.add(NVLINK, None, f"GPUs {linked} have active NVLinks, but without {TOPO} the pairs are "
                     "unknown; boards not derived")
    _check_link_counts(pairs, nvlink, topology, warnings)
    known = {gpu.index for gpu in gpus}
    if known:
        strays = [pair for pair in pairs if pair[0] not in known or pair[1] not in known]
        for i, j, _ in strays:
            warnings.add(TOPO, None, f"NVLink pair GPU{i}-GPU{j} names a GPU that nvidia-smi does not list; ignored")
        pairs = [pair for pair in pairs if pair not in strays]
    return pairs


def _check_link_counts(pairs: list[tuple[int, int, int]], nvlink: dict[int, NvlinkGpu], topology: Topology,
                       warnings: Warnings) -> None:
    """``nvlink -s`` counts links per GPU; the matrix's NV# cells around that GPU must add up to it."""
    if not topology.gpus:
        return
    for index, gpu in sorted(nvlink.items()):
        in_matrix = sum(count for i, j, count in pairs if index in (i, j))
        if index in topology.gpus and gpu.active_links != in_matrix:
            warnings.add(NVLINK, gpu.line, f"GPU {index} has {gpu.active_links} active NVLinks but {TOPO} shows "
                         f"{in_matrix}; a bridge or link may be faulty")


# ---------------------------------------------------------------------------------------- CPU, OS


def _cpu(outputs: Mapping[str, str], windows: WindowsFacts, warnings: Warnings) -> Cpu:
    cpuinfo = _guarded(outputs, CPUINFO, parse_cpuinfo, CpuFacts, warnings)
    lscpu = _guarded(outputs, LSCPU, parse_lscpu, CpuFacts, warnings)
    nproc = _guarded(outputs, NPROC, parse_nproc, lambda: None, warnings)
    win = CpuFacts(windows.cpu_model, windows.cores, windows.threads, windows.flags)
    flags = cpuinfo.flags or lscpu.flags or win.flags
    return Cpu(
        model=cpuinfo.model or lscpu.model or win.model,
        cores=cpuinfo.cores or lscpu.cores or win.cores,
        threads=cpuinfo.threads or nproc or lscpu.threads or win.threads,
        flags=flags,
        avx2="avx2" in flags,
        avx512=any(flag == "avx512f" for flag in flags),
    )


def _os_info(outputs: Mapping[str, str], table: SmiReading, csv_reading: SmiReading, windows: WindowsFacts,
             warnings: Warnings) -> OsInfo:
    release = _guarded(outputs, OS_RELEASE, parse_os_release, OsRelease, warnings)
    kernel = outputs.get(PROC_VERSION, "")
    if looks_binary(kernel):
        warnings.add(PROC_VERSION, None, "is not text (binary data); ignored")
        kernel = ""
    kernel = "\n".join(line.text for line in clean_lines(kernel))
    linux_seen = bool(release.name or release.id or re.match(r"\s*Linux version", kernel)
                      or _has_line(outputs, CPUINFO, r"processor\s*:") or _has_line(outputs, MEMINFO, r"MemTotal:"))
    smi_mismatch = bool(table.smi_version and table.driver_version and table.smi_version != table.driver_version)
    wsl = (is_wsl_kernel(kernel) if kernel.strip() else False) or (smi_mismatch and not windows.found)
    if windows.found:
        if linux_seen:
            warnings.add(WINDOWS_CIM, None, "found beside Linux outputs (os-release, cpuinfo...); reported Windows")
        return OsInfo(family="windows", name=windows.os_name, version=windows.os_version, wsl=False)
    if linux_seen or wsl:
        return OsInfo(family="linux", name=release.name, version=release.version, wsl=wsl)
    if table.windows_layout or csv_reading.windows_layout or any(g.driver_model for g in csv_reading.gpus.values()):
        return OsInfo(family="windows")  # only nvidia-smi.exe prints a driver model
    return OsInfo()


def _has_line(outputs: Mapping[str, str], name: str, pattern: str) -> bool:
    """Evidence of Linux is a line only Linux prints, not merely a file that is there."""
    return any(re.match(pattern, line.text) for line in clean_lines(outputs.get(name, "")))


# -------------------------------------------------------------------------------------------- disks


def _disks(outputs: Mapping[str, str], windows: WindowsFacts, model_dir: str | None, warnings: Warnings) -> list[Disk]:
    rows: list[DfRow] = _guarded(outputs, DF, parse_df, list, warnings)
    disks = [Disk(path=(model_dir if position == 0 and model_dir else row.mount), filesystem=row.filesystem,
                  total_mib=row.total_mib, free_mib=row.free_mib) for position, row in enumerate(rows)]
    if windows.disks:
        disks.extend(_windows_disks(windows, model_dir))
    return disks


def _windows_disks(windows: WindowsFacts, model_dir: str | None) -> list[Disk]:
    """Every fixed drive; the one holding ``model_dir`` first, carrying that path."""
    drive = re.match(r"^([A-Za-z]:)", model_dir or "")
    wanted = drive.group(1).upper() if drive else None
    ordered = sorted(windows.disks, key=lambda disk: disk.device != wanted)
    return [Disk(path=(model_dir if model_dir and disk.device == wanted else disk.device + "\\"),
                 filesystem=disk.filesystem, total_mib=disk.total_mib, free_mib=disk.free_mib) for disk in ordered]
