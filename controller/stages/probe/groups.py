"""Inventory groups of a box, derived from its hardware profile, so group_vars can target them.

Every box gets at most one OS group and exactly one GPU-shape group.

OS groups (none when the probe could not tell the OS):

* ``windows`` -- native Windows (``os.family == "windows"``).
* ``wsl`` -- a Linux guest under WSL (``os.wsl``). Its own group, not ``linux``: the driver belongs to
  the Windows host, the V100 must be in MCDM mode, and models must stay on the guest's filesystem.
* ``linux`` -- Linux on the metal or in a VM (``os.family == "linux"`` and not WSL).

GPU-shape groups (checked in this order, first match wins):

* ``cpu_only`` -- no GPU visible (also a box whose driver is not installed yet).
* ``mixed`` -- at least one GPU that is not a Tesla V100 (an RTX 3090 beside V100s, or no V100 at
  all): the sm_70 engines use only the V100s, so such a box needs explicit GPU selection.
* ``single_v100_16g`` / ``single_v100_32g`` -- exactly one GPU, a V100. 32g when it reports at least
  :data:`V100_32G_MIN_MIB` (32 GB cards report 32510-32768 MiB, 16 GB cards 16130-16160); when the
  memory is unknown, 32g only if the name says 32GB, otherwise the smaller card is assumed.
* ``dual_nvlink`` -- exactly two V100s joined by NVLink (one board of two).
* ``multi_board`` -- two or more V100s in any other arrangement: several NVLink boards (the 12-GPU
  box), PCIe-only cards (each a board of one), or one board of more than two (DGX-1, AWS p3). The
  planner must choose a board per model; V100s of different sizes stay here (per-GPU memory is in
  the profile).
"""

from __future__ import annotations

from controller.model.profile import Gpu, HardwareProfile

OS_GROUPS = ("linux", "windows", "wsl")
SHAPE_GROUPS = ("cpu_only", "single_v100_16g", "single_v100_32g", "dual_nvlink", "multi_board", "mixed")
V100_32G_MIN_MIB = 24 * 1024


def os_group(profile: HardwareProfile) -> str | None:
    if profile.os.family == "windows":
        return "windows"
    if profile.os.wsl:
        return "wsl"
    if profile.os.family == "linux":
        return "linux"
    return None


def _is_32g(gpu: Gpu) -> bool:
    if gpu.memory_mib is not None:
        return gpu.memory_mib >= V100_32G_MIN_MIB
    return "32GB" in gpu.name.upper().replace(" ", "")


def shape_group(profile: HardwareProfile) -> str:
    gpus = profile.gpus
    if not gpus:
        return "cpu_only"
    if not all(gpu.is_v100 for gpu in gpus):
        return "mixed"
    if len(gpus) == 1:
        return "single_v100_32g" if _is_32g(gpus[0]) else "single_v100_16g"
    if len(gpus) == 2 and sorted(len(board) for board in profile.boards) == [2]:
        return "dual_nvlink"
    return "multi_board"


def group_names(profile: HardwareProfile) -> list[str]:
    """The inventory groups of a box: its OS group (if known), then its GPU-shape group."""
    names = [os_group(profile), shape_group(profile)]
    return [name for name in names if name is not None]
