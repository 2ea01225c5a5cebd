"""Parsers for ``nvidia-smi topo -m`` (the link matrix) and ``nvidia-smi nvlink -s`` (links per GPU).

The matrix is read by whitespace tokens, not by columns: people paste it with tabs or with the tabs
expanded to spaces, affinity cells may be blank (which shifts tab-split columns), NIC columns
(``NIC3`` or ``mlx5_2``) sit between or after the GPUs in any order, and newer drivers add
``NUMA Affinity`` and ``GPU NUMA ID``. Link cells are never blank, so the first N tokens after a row
label are the N device columns of the header, and what follows is affinity.

Boards are what the planner needs: GPUs joined by NVLink, as connected groups. A model kept inside
one board never crosses PCIe/NUMA; the link count (NV1, NV2, NV6, ...) says how fat each hop is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from controller.stages.probe.text import Line, Warnings, clean_lines, has_content, looks_binary, shorten

# SOC is what drivers before ~R384 printed for SYS. PXN and NV# variants are all link codes.
_LINK_CODE = re.compile(r"^(X|SYS|SOC|NODE|PHB|PXB|PIX|PXN|NV\d+|CNV\d*)$", re.IGNORECASE)
_AFFINITY_LABELS = re.compile(r"CPU\s+Affinity|NUMA\s+Affinity|GPU\s+NUMA\s+ID", re.IGNORECASE)
_GPU_LABEL = re.compile(r"^GPU(\d+)$", re.IGNORECASE)
_LEGEND = re.compile(r"^\s*(NIC\s+)?Legend\s*:", re.IGNORECASE)


@dataclass
class Topology:
    gpus: list[int] = field(default_factory=list)  # GPU indices that have a row in the matrix
    links: dict[tuple[int, int], int] = field(default_factory=dict)  # (i, j) with i < j -> NVLink count
    cpu_affinity: dict[int, str] = field(default_factory=dict)
    numa_affinity: dict[int, str] = field(default_factory=dict)


def parse_topo(text: str, warnings: Warnings, file: str = "nvidia-smi-topo.txt") -> Topology:
    """Read a ``topo -m`` or ``topo -mp`` matrix; NIC rows and columns are read past, GPU cells kept."""
    topology = Topology()
    if looks_binary(text):
        warnings.add(file, None, "is not text (binary data); ignored")
        return topology
    lines = _matrix_lines(clean_lines(text))
    if not lines:
        if has_content(text):
            warnings.add(file, None, "no topo matrix found (expected a header row naming GPU0 ...)")
        return topology
    header, rows = lines[0], lines[1:]
    columns, affinity_labels = _header_columns(header.text)
    cells: dict[tuple[int, int], tuple[str, int]] = {}
    for row in rows:
        _read_row(row, columns, affinity_labels, topology, cells, warnings, file)
    _pair_links(cells, topology, warnings, file)
    return topology


def _matrix_lines(lines: list[Line]) -> list[Line]:
    """The header line and the rows under it, up to the first blank line or Legend block."""
    start = next((i for i, line in enumerate(lines) if _is_header(line.text.split())), None)
    if start is None:
        return []
    matrix = [lines[start]]
    for line in lines[start + 1:]:
        if not line.text.strip() or _LEGEND.match(line.text):
            break
        matrix.append(line)
    return matrix


def _is_header(tokens: list[str]) -> bool:
    """The header names GPU0 and, unlike the GPU0 row, has no link code right after its first token."""
    return "GPU0" in (token.upper() for token in tokens) and (len(tokens) < 2 or not _LINK_CODE.match(tokens[1]))


def _header_columns(text: str) -> tuple[list[str], list[str]]:
    first_affinity = _AFFINITY_LABELS.search(text)
    device_part = text[: first_affinity.start()] if first_affinity else text
    labels = [re.sub(r"\s+", " ", match.group(0)) for match in _AFFINITY_LABELS.finditer(text)]
    return device_part.split(), labels


def _read_row(row: Line, columns: list[str], affinity_labels: list[str], topology: Topology,
              cells: dict[tuple[int, int], tuple[str, int]], warnings: Warnings, file: str) -> None:
    tokens = row.text.split()
    label, values = tokens[0], tokens[1:]
    link_cells = []
    for value in values[: len(columns)]:
        if not _LINK_CODE.match(value):
            break
        link_cells.append(value)
    extra = values[len(link_cells):]
    surplus = 0
    while surplus < len(extra) and _LINK_CODE.match(extra[surplus]):
        surplus += 1
    if surplus:
        warnings.add(file, row.number, f"row {label} has {len(link_cells) + surplus} link cells, the header names "
                     f"{len(columns)} columns; ignored the extra cells")
        extra = extra[surplus:]
    gpu = _GPU_LABEL.match(label)
    if len(link_cells) < len(columns):
        warnings.add(file, row.number, f"row {label} has {len(link_cells)} link cells, the header names "
                     f"{len(columns)} columns; read the cells that line up")
    if gpu is None:
        return  # a NIC row: its cells say nothing about GPU-to-GPU links
    index = int(gpu.group(1))
    if index in topology.gpus:
        warnings.add(file, row.number, f"row {label} appears twice; kept the first")
        return
    topology.gpus.append(index)
    _read_affinity(index, extra, affinity_labels, topology, row, warnings, file)
    for column, value in zip(columns, link_cells):
        peer = _GPU_LABEL.match(column)
        if peer is not None:
            cells[(index, int(peer.group(1)))] = (value.upper(), row.number)


def _read_affinity(index: int, extra: list[str], labels: list[str], topology: Topology, row: Line,
                   warnings: Warnings, file: str) -> None:
    if len(extra) > max(len(labels), 0):
        warnings.add(file, row.number, f"row GPU{index} has unexpected cells after the matrix: "
                     f"{shorten(' '.join(extra[len(labels):]))!r}")
    for label, value in zip(labels, extra):
        if label.lower() == "cpu affinity":
            topology.cpu_affinity[index] = value
        elif label.lower() == "numa affinity":
            topology.numa_affinity[index] = value


def _link_count(code: str) -> int:
    match = re.fullmatch(r"NV(\d+)", code)
    return int(match.group(1)) if match else 0


def _pair_links(cells: dict[tuple[int, int], tuple[str, int]], topology: Topology, warnings: Warnings,
                file: str) -> None:
    """Turn NV# cells into pair link counts; the two halves of a symmetric matrix must agree."""
    for (i, j), (code, number) in sorted(cells.items()):
        if i == j:
            if code != "X":
                warnings.add(file, number, f"GPU{i} to itself reads {code!r}, expected X")
            continue
        if i > j and (j, i) in cells:
            continue  # judged from the other half
        mirror = cells.get((j, i))
        count = _link_count(code)
        if mirror is not None and _link_count(mirror[0]) != count:
            warnings.add(file, mirror[1], f"GPU{j}-GPU{i} reads {mirror[0]} but GPU{i}-GPU{j} reads {code}; "
                         "kept the larger link count")
            count = max(count, _link_count(mirror[0]))
        if count:
            topology.links[(min(i, j), max(i, j))] = count


# ------------------------------------------------------------------------------------ nvlink -s

_NVLINK_GPU = re.compile(r"^\s*GPU\s+(\d+)\s*:\s*(?P<name>.*?)\s*(?:\(UUID:\s*(?P<uuid>[^)\s]+)\s*\))?\s*$")
_NVLINK_LINK = re.compile(r"^\s*Link\s+(\d+)\s*:\s*(?P<state>.*?)\s*$", re.IGNORECASE)
_SPEED = re.compile(r"^(\d+(?:\.\d+)?)\s*([GM])B/s$", re.IGNORECASE)


@dataclass
class NvlinkGpu:
    index: int
    line: int
    name: str | None = None
    uuid: str | None = None
    active_links: int = 0
    inactive_links: int = 0


def parse_nvlink_status(text: str, warnings: Warnings, file: str = "nvidia-smi-nvlink.txt") -> dict[int, NvlinkGpu]:
    """Count active NVLinks per GPU from ``nvidia-smi nvlink -s``."""
    gpus: dict[int, NvlinkGpu] = {}
    if looks_binary(text):
        warnings.add(file, None, "is not text (binary data); ignored")
        return gpus
    current: NvlinkGpu | None = None
    for line in clean_lines(text):
        if not line.text.strip():
            continue
        head = _NVLINK_GPU.match(line.text)
        link = _NVLINK_LINK.match(line.text)
        if head:
            current = NvlinkGpu(int(head.group(1)), line.number, head.group("name") or None, head.group("uuid"))
            gpus.setdefault(current.index, current)
        elif link and current is not None:
            _count_link(link.group("state"), current, line, warnings, file)
        elif "inactive" in line.text.lower() or "nvml:" in line.text.lower():
            continue  # "all links are inActive" style notes: the GPU simply has no active link
        else:
            warnings.add(file, line.number, f"line not understood: {shorten(line.text)!r}")
    return gpus


def _count_link(state: str, gpu: NvlinkGpu, line: Line, warnings: Warnings, file: str) -> None:
    if _SPEED.match(state):
        gpu.active_links += 1
    elif "inactive" in state.lower():
        gpu.inactive_links += 1
    else:
        warnings.add(file, line.number, f"link state {shorten(state)!r} not understood; counted as inactive")
        gpu.inactive_links += 1


# ---------------------------------------------------------------------------------------- boards


def boards(indices: Iterable[int], pairs: Iterable[tuple[int, int, int]]) -> list[list[int]]:
    """Connected groups of GPUs over NVLink pairs; each sorted, groups by first index, lone GPUs alone."""
    parent: dict[int, int] = {index: index for index in indices}

    def root(node: int) -> int:
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for i, j, links in pairs:
        if links <= 0:
            continue
        parent.setdefault(i, i)
        parent.setdefault(j, j)
        parent[root(i)] = root(j)
    groups: dict[int, list[int]] = {}
    for node in parent:
        groups.setdefault(root(node), []).append(node)
    return sorted((sorted(group) for group in groups.values()), key=lambda group: group[0])
