"""The NVIDIA driver window for Volta, and the warning a probe adds when a box is outside it.

The prebuilt sm_70 engines are CUDA 12.8 builds: they need R570 or newer (on R535 they fail with
``device kernel image is invalid`` and silently fall back to the CPU). Volta support ends with the
R580 branch. Windows releases of a branch are numbered past it (R580 ships as 580.xx-581.xx, R570 as
570.xx-573.xx), so the window is the majors 570-589. The provisioning refusal is elsewhere; the probe
only reports, because no driver at all is a normal state that the driver role fixes.
"""

from __future__ import annotations

import re

FIRST_SUPPORTED_MAJOR = 570
LAST_SUPPORTED_MAJOR = 589  # the R580 branch, including its Windows 58x.xx releases
WINDOWS_DRIVER = "573.96"  # the R570 data-center driver the kit installs on Windows


def driver_major(version: str) -> int | None:
    match = re.match(r"^\s*(\d{3})(?:\.|$)", version)
    return int(match.group(1)) if match else None


def recommended_driver(os_family: str | None, wsl: bool) -> str:
    """The driver to install, said the way an operator would act on it."""
    if wsl:
        return f"the R570 data-center driver {WINDOWS_DRIVER} on the Windows host (WSL uses the host's driver)"
    if os_family == "windows":
        return f"the R570 data-center driver {WINDOWS_DRIVER}"
    return "an R580 driver with the proprietary kernel modules (the open modules do not support Volta)"


def driver_window_problem(version: str, *, has_volta: bool, os_family: str | None, wsl: bool) -> str | None:
    """Why ``version`` cannot run the sm_70 engines, or None when it can (or no V100 cares)."""
    major = driver_major(version)
    if major is None:
        return f"driver version {version!r} not understood; expected e.g. 580.95.05"
    install = recommended_driver(os_family, wsl)
    if major < FIRST_SUPPORTED_MAJOR:
        return (f"driver {version} (R{major}) is older than R570, which the CUDA 12.8 sm_70 builds need "
                f"(on older drivers they fall back to the CPU); install {install}")
    if major > LAST_SUPPORTED_MAJOR and has_volta:
        return (f"driver {version} (R{major}) is newer than the R580 branch, the last to support Volta "
                f"(Tesla V100); install {install}")
    return None
