"""The hardware profile: what the probe saw on a box, as typed data.

This is the JSON contract of ``controller probe --json``; extend it, never rename fields.
"""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from controller.model.inputs import MAX_GPU_INDEX, MAX_GPU_MIB
from controller.model.rules import VOLTA_ARCH, cuda_arch, is_v100

# Sizes a saved profile may give: 0 and up, and finite (JSON allows NaN and Infinity, which "fit" or break a plan).
Mib = Annotated[int, Field(ge=0, le=2**40)]  # a host's memory or a disk, in MiB: at most 1 EiB
Reading = Annotated[float, Field(allow_inf_nan=False)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Gpu(_Model):
    index: int
    uuid: str | None = None
    name: str
    memory_mib: int | None = Field(default=None, ge=0, le=MAX_GPU_MIB)
    compute_capability: str | None = None  # "7.0" form
    pci_bus_id: str | None = None
    serial: str | None = None
    power_limit_w: Annotated[Reading, Field(ge=0)] | None = None
    temperature_c: Reading | None = None
    # The Linux device node's minor number (/dev/nvidia<minor>; nvidia-smi -q "Minor Number"). It is not the
    # index: nvidia-smi numbers the cards by PCI bus, the driver numbers its nodes as it found the cards.
    # None: not probed (a profile from before it was recorded, or Windows, which has no such node). 254 and 255 are
    # the driver's own nodes (nvidia-modeset, nvidiactl), never a card's.
    minor_number: int | None = Field(default=None, ge=0, le=253)

    @property
    def is_v100(self) -> bool:
        return is_v100(self.name)

    @property
    def arch(self) -> int | None:
        """The card's CUDA architecture (86 for compute capability 8.6); a V100 is sm_70 even unprobed."""
        return cuda_arch(self.compute_capability) or (VOLTA_ARCH if self.is_v100 else None)


class Driver(_Model):
    version: str | None = None
    cuda_version: str | None = None
    model: Literal["TCC", "WDDM", "MCDM"] | None = None


class NvLink(_Model):
    pairs: list[tuple[int, int, int]] = Field(default_factory=list)  # (gpu i, gpu j, link count), i < j


class Cpu(_Model):
    model: str | None = None
    cores: int | None = Field(default=None, ge=1, le=2**20)  # physical cores
    threads: int | None = Field(default=None, ge=1, le=2**20)
    flags: list[str] = Field(default_factory=list)
    avx2: bool = False
    avx512: bool = False


class OsInfo(_Model):
    family: Literal["linux", "windows"] | None = None
    name: str | None = None
    version: str | None = None
    wsl: bool = False


class Disk(_Model):
    path: str
    filesystem: str | None = None
    total_mib: Mib | None = None
    free_mib: Mib | None = None


class HardwareProfile(_Model):
    gpus: list[Gpu] = Field(default_factory=list)
    driver: Driver = Field(default_factory=Driver)
    nvlink: NvLink = Field(default_factory=NvLink)
    boards: list[list[int]] = Field(default_factory=list)
    cpu: Cpu = Field(default_factory=Cpu)
    memory_mib: Mib | None = None
    os: OsInfo = Field(default_factory=OsInfo)
    disks: list[Disk] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)

    def gpu_index_problem(self) -> str | None:
        """Why the GPU indices cannot be used as CUDA device numbers, or None when they can.

        Each index becomes a CUDA_VISIBLE_DEVICES entry: a negative one hides every GPU, a repeated one
        makes two services share a card the plan gave to one, and one beyond nvidia-smi's numbering (or an NVLink
        pair or board naming such a card) is a damaged or hand-made profile, never a box.
        """
        indices = [gpu.index for gpu in self.gpus]
        negative = sorted({index for index in indices if index < 0})
        if negative:
            return f"GPU index {negative[0]} is negative; GPU indices are nvidia-smi's, 0 and up"
        beyond = sorted({index for index in indices if index > MAX_GPU_INDEX})
        if beyond:
            return (f"GPU index {beyond[0]} is beyond nvidia-smi's numbering (0 to {MAX_GPU_INDEX}; a box has at most "
                    f"{MAX_GPU_INDEX + 1} GPUs)")
        counts = Counter(indices)
        repeated = sorted(index for index, count in counts.items() if count > 1)
        if repeated:
            return f"GPU index {repeated[0]} is listed twice; each GPU appears once, with its own nvidia-smi index"
        for i, j, links in self.nvlink.pairs:
            stray = next((index for index in (i, j) if not 0 <= index <= MAX_GPU_INDEX), None)
            if stray is not None:
                return f"nvlink pair {i}-{j} names GPU {stray}, beyond nvidia-smi's numbering (0 to {MAX_GPU_INDEX})"
            if i == j:
                return f"nvlink pair {i}-{j} links GPU {i} to itself; a pair names two GPUs"
            if not 0 <= links <= MAX_GPU_INDEX:
                return f"nvlink pair {i}-{j} has {links} links; a pair has 0 or more, a handful at most"
        on_board: set[int] = set()
        for board in self.boards:
            stray = next((index for index in board if not 0 <= index <= MAX_GPU_INDEX), None)
            if stray is not None:
                return f"a board names GPU {stray}, beyond nvidia-smi's numbering (0 to {MAX_GPU_INDEX})"
            twice = next((index for index in board if index in on_board), None)
            if twice is not None:
                return f"GPU {twice} is on two boards (or twice on one); each GPU sits on one NVLink board"
            on_board.update(board)
        return None

    @property
    def usable(self) -> bool:
        """True when the probe learned anything at all about the box."""
        return bool(self.gpus or self.nvlink.pairs or self.boards or self.driver.version or self.cpu.model
                    or self.cpu.threads or self.memory_mib or self.os.family)
