"""The facts the product encodes, each defined once.

Every other place (the probe's warnings, fleet validation, the planner, the rendered inventory, and
through it the roles) takes these values from here; a role never restates them.
"""

from __future__ import annotations

from typing import Literal

# The host a URL names to reach a server from its own box (a wildcard bind: loopback; IPv6: bracketed). The roles
# (filter v100box.llm.reachable_host) and llama_burn_in on the box apply the same rule: one copy, in the collection.
from ansible_collections.v100box.llm.plugins.module_utils.hosts import reachable_host as reachable_host

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

# The agent clients a fleet may name (`agents: [claude-code, openclaw]`) and the context each needs,
# (at least, preferred) in tokens. Claude Code's system prompt and tools are 10-24k tokens before the
# user says anything, so it needs that plus room to work; OpenClaw's prompt is ~22k and a smaller
# contextWindow than 64k makes it silently drop replies.
AgentClient = Literal["claude-code", "openclaw"]
AGENT_CLIENT_CTX: dict[str, tuple[int, int]] = {"claude-code": (32768, 65536), "openclaw": (65536, 65536)}

# How long a client and the gateway wait on a silent stream. llama-server sends a stream's headers at once
# and then nothing until the prompt is processed; a cold 24k-token prompt on an offloading V100 takes
# minutes, and Claude Code 2.1 gives up after 300 s of silence (measured; docs/gateway.md) unless told more.
STREAM_SILENCE_S = 3600

# Where a box keeps its models and its chat templates.
DEFAULT_MODEL_DIR: dict[str, str] = {"linux": "/var/lib/llama/models", "windows": "C:\\llama\\models"}
TEMPLATE_DIR: dict[str, str] = {"linux": "/etc/llama/templates", "windows": "C:\\llama\\templates"}
# Where an on-demand group's router reads its models' preset file (llama_service writes it there).
PRESET_DIR: dict[str, str] = {"linux": "/etc/llama/presets", "windows": "C:\\llama\\presets"}


# CUDA architectures, written as CMake's CMAKE_CUDA_ARCHITECTURES numbers (compute capability 8.6 -> 86).
# The kit's packs carry machine code for Volta only (sm_70). A build runs on a card when it carries code for
# the card's major version at a minor no higher than the card's (CUDA's binary compatibility: sm_80 code
# runs on an 8.6 card, sm_70 on a 7.5 one, never across majors); packs carry no PTX to JIT for newer cards.
VOLTA_ARCH = 70
ARCH_NAMES = {3: "Kepler", 5: "Maxwell", 6: "Pascal", 70: "Volta", 72: "Volta", 75: "Turing", 8: "Ampere",
              89: "Ada", 9: "Hopper", 10: "Blackwell", 12: "Blackwell"}
# NVIDIA retires old architectures from new driver branches: Kepler (sm_3x) ended with R470; Maxwell, Pascal
# and Volta (up to sm_72) end with R580, whose successor R595 ignores a V100. Turing and newer have no last
# branch yet, and every architecture up to Blackwell (sm_100, sm_120) is driven by R570 and R580 alike.
LAST_KEPLER_BRANCH = 470
LAST_VOLTA_ARCH = 72
NEWEST_KNOWN_ARCH = 121


def cuda_arch(compute_capability: str | None) -> int | None:
    """The CMake architecture number of a "7.0"-form compute capability (70), or None if it is not one."""
    major, dot, minor = str(compute_capability or "").strip().partition(".")
    if not (dot and major.isdigit() and minor.isdigit() and len(minor) == 1):
        return None
    return int(major) * 10 + int(minor)


def arch_label(arch: int) -> str:
    """``sm_86 (Ampere)``: the architecture as people name it."""
    name = ARCH_NAMES.get(arch) or ARCH_NAMES.get(arch // 10)
    return f"sm_{arch}" + (f" ({name})" if name else "")


def build_runs_on(archs: list[int] | tuple[int, ...], arch: int | None) -> bool:
    """Whether a build carrying machine code for ``archs`` runs on a card of architecture ``arch``."""
    if arch is None:
        return False
    return any(built // 10 == arch // 10 and built % 10 <= arch % 10 for built in archs)


def last_branch(arch: int) -> int | None:
    """The last driver branch that drives cards of ``arch``, or None while NVIDIA still supports it."""
    if arch < 50:
        return LAST_KEPLER_BRANCH
    if arch <= LAST_VOLTA_ARCH:
        return DRIVER_BRANCHES[-1]
    return None


def branch_problem(arch: int | None, branch: int) -> str | None:
    """Why driver branch ``branch`` cannot drive a card of ``arch``, or None when it can."""
    if arch is None:
        return "its compute capability is unknown, so whether the branch drives it cannot be checked"
    last = last_branch(arch)
    if last is not None and branch > last:
        return f"{arch_label(arch)} is driven up to R{last} only"
    if arch > NEWEST_KNOWN_ARCH:
        return f"{arch_label(arch)} is newer than any card whose driver branches this product knows"
    return None


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
