"""The hardware profile: what the probe saw on a box, as typed data.

This is the JSON contract of ``controller probe --json``; extend it, never rename fields.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from controller.facts import VOLTA_ARCH, cuda_arch, is_v100


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Gpu(_Model):
    index: int
    uuid: str | None = None
    name: str
    memory_mib: int | None = None
    compute_capability: str | None = None  # "7.0" form
    pci_bus_id: str | None = None
    serial: str | None = None
    power_limit_w: float | None = None
    temperature_c: float | None = None

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
    cores: int | None = None  # physical cores
    threads: int | None = None
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
    total_mib: int | None = None
    free_mib: int | None = None


class HardwareProfile(_Model):
    gpus: list[Gpu] = Field(default_factory=list)
    driver: Driver = Field(default_factory=Driver)
    nvlink: NvLink = Field(default_factory=NvLink)
    boards: list[list[int]] = Field(default_factory=list)
    cpu: Cpu = Field(default_factory=Cpu)
    memory_mib: int | None = None
    os: OsInfo = Field(default_factory=OsInfo)
    disks: list[Disk] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)

    def gpu_index_problem(self) -> str | None:
        """Why the GPU indices cannot be used as CUDA device numbers, or None when they can.

        Each index becomes a CUDA_VISIBLE_DEVICES entry: a negative one hides every GPU, a repeated one
        makes two services share a card the plan gave to one.
        """
        indices = [gpu.index for gpu in self.gpus]
        negative = sorted({index for index in indices if index < 0})
        if negative:
            return f"GPU index {negative[0]} is negative; GPU indices are nvidia-smi's, 0 and up"
        repeated = sorted({index for index in indices if indices.count(index) > 1})
        if repeated:
            return f"GPU index {repeated[0]} is listed twice; each GPU appears once, with its own nvidia-smi index"
        return None

    @property
    def usable(self) -> bool:
        """True when the probe learned anything at all about the box."""
        return bool(self.gpus or self.nvlink.pairs or self.boards or self.driver.version or self.cpu.model
                    or self.cpu.threads or self.memory_mib or self.os.family)
