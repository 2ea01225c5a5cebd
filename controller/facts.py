"""The facts the product encodes, each defined once.

Every other place (the probe's warnings, fleet validation, the planner, the rendered inventory, and
through it the roles) takes these values from here; a role never restates them.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

OsName = Literal["linux", "windows"]

# The prebuilt sm_70 engines are CUDA 12.8 builds: they need an R570 driver or newer (on R535 they
# fail with "device kernel image is invalid" and fall back to the CPU). Volta support ends with the R580
# branch, whose Windows releases are numbered past it (580.xx-581.xx), so the window is the majors 570-589.
DRIVER_FIRST_MAJOR = 570
DRIVER_LAST_MAJOR = 589
DRIVER_BRANCHES = (570, 580)  # the Linux branches a fleet may pin
DRIVER_DEFAULT_BRANCH = 580
DRIVER_WINDOW = f"R{DRIVER_BRANCHES[0]}-R{DRIVER_BRANCHES[-1]}"
WINDOWS_DRIVER = "573.96"  # the R570 data-center driver the kit installs on Windows

# Where a box keeps its models and its chat templates.
DEFAULT_MODEL_DIR: dict[str, str] = {"linux": "/var/lib/llama/models", "windows": "C:\\llama\\models"}
TEMPLATE_DIR: dict[str, str] = {"linux": "/etc/llama/templates", "windows": "C:\\llama\\templates"}


def is_v100(gpu_name: str) -> bool:
    """Whether a GPU's product name (as nvidia-smi reports it) is a Tesla V100."""
    return "V100" in str(gpu_name).upper()


def driver_window() -> dict[str, object]:
    """The window as the roles receive it through the inventory."""
    return {"first_major": DRIVER_FIRST_MAJOR, "last_major": DRIVER_LAST_MAJOR, "label": DRIVER_WINDOW,
            "branches": list(DRIVER_BRANCHES)}


def box_path(os: str, folder: str, name: str) -> str:
    """A file in a folder on a box of that OS: Windows paths are joined with backslashes."""
    sep = "\\" if os == "windows" else "/"
    return folder.rstrip("/\\") + sep + name


def reachable_host(bind: str) -> str:
    """The host part of a URL that reaches a server bound to ``bind`` from the box itself.

    A wildcard bind is reached on loopback of the same family; an IPv6 address is bracketed.
    """
    text = str(bind).strip().strip("[]")
    if text in ("", "0.0.0.0"):
        return "127.0.0.1"
    if text == "::":
        return "[::1]"
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return text  # a host name
    return f"[{address}]" if address.version == 6 else str(address)
