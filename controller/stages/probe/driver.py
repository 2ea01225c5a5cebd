"""Whether an installed NVIDIA driver can run the sm_70 engines, said the way an operator acts on it.

The window itself is defined in ``controller.model.rules``. The probe only reports (no driver at all is a
normal state that the driver role fixes); provisioning refuses a box outside the window.
"""

from __future__ import annotations

import re

from controller.model.rules import DRIVER_BRANCHES, DRIVER_FIRST_MAJOR, DRIVER_LAST_MAJOR, WINDOWS_DRIVER


def driver_major(version: str) -> int | None:
    match = re.match(r"^\s*(\d{3})(?:\.|$)", version)
    return int(match.group(1)) if match else None


def recommended_driver(os_family: str | None, wsl: bool) -> str:
    """The driver to install, said the way an operator would act on it."""
    if wsl:
        return f"the R{DRIVER_BRANCHES[0]} data-center driver {WINDOWS_DRIVER} on the Windows host (WSL uses the host's driver)"
    if os_family == "windows":
        return f"the R{DRIVER_BRANCHES[0]} data-center driver {WINDOWS_DRIVER}"
    return f"an R{DRIVER_BRANCHES[-1]} driver with the proprietary kernel modules (the open modules do not support Volta)"


def driver_window_problem(version: str, *, has_volta: bool, os_family: str | None, wsl: bool) -> str | None:
    """Why ``version`` cannot run the sm_70 engines, or None when it can (or no V100 cares)."""
    major = driver_major(version)
    if major is None:
        return f"driver version {version!r} not understood; expected e.g. 580.95.05"
    install = recommended_driver(os_family, wsl)
    if major < DRIVER_FIRST_MAJOR:
        return (f"driver {version} (R{major}) is older than R{DRIVER_FIRST_MAJOR}, which the CUDA 12.8 sm_70 builds need "
                f"(on older drivers they fall back to the CPU); install {install}")
    if major > DRIVER_LAST_MAJOR and has_volta:
        return (f"driver {version} (R{major}) is newer than the R{DRIVER_BRANCHES[-1]} branch, the last to support Volta "
                f"(Tesla V100); install {install}")
    return None
