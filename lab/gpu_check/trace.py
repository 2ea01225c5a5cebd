"""What a traced llama-server did (``strace -f``), and whether the llama_service unit would have let it.

:func:`parse_strace` reads strace's text into :class:`TraceFacts`: the system calls made, every /dev, /proc and
/sys path touched (with counts, as ../shared/fixtures/gpu-h100-580/cuda-paths-opened.txt records them), the
device nodes opened, the socket families asked for, the mappings made writable and executable, the files opened
for writing and the programs run. :func:`recorded_facts` rebuilds the same facts, as far as they go, from the
two files an earlier run recorded. :func:`check_trace` holds them against a :class:`~lab.gpu_check.unit.UnitPolicy`.
All of it is pure: the tests run it on the recorded H100 trace and on a trace of the CPU server.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from lab.gpu_check.unit import SyscallPolicy, UnitPolicy

# Calls whose string arguments are file names (strace prints them quoted).
PATH_CALLS = frozenset({
    "open", "openat", "openat2", "creat", "stat", "lstat", "newfstatat", "fstatat64", "statx", "access", "faccessat",
    "faccessat2", "readlink", "readlinkat", "symlink", "symlinkat", "mkdir", "mkdirat", "unlink", "unlinkat", "rmdir",
    "execve", "execveat", "chdir", "rename", "renameat", "renameat2", "link", "linkat", "truncate", "statfs",
    "chmod", "fchmodat", "chown", "fchownat", "lchown", "utimensat", "getxattr", "lgetxattr", "listxattr",
    "inotify_add_watch", "mknod", "mknodat",
})
OPEN_CALLS = frozenset({"open", "openat", "openat2", "creat"})
MODIFYING_CALLS = frozenset({"mkdir", "mkdirat", "symlink", "symlinkat", "unlink", "unlinkat", "rmdir", "rename",
                             "renameat", "renameat2", "link", "linkat", "truncate", "mknod", "mknodat", "chmod",
                             "fchmodat", "chown", "fchownat", "lchown", "utimensat"})
_WRITE_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC")
# Under /dev but no device node: shared memory, message queues, hugepage mounts, the fd links.
_NOT_DEVICES = ("/dev/shm/", "/dev/mqueue/", "/dev/hugepages/", "/dev/fd/", "/dev/stdin", "/dev/stdout",
                "/dev/stderr")
# What DevicePolicy=closed opens besides DeviceAllow= (systemd's pseudo devices, and the pty nodes).
CLOSED_POLICY_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty",
                         "/dev/ptmx")
# /proc paths a ProcSubset=pid unit still sees.
_PID_PROC = re.compile(r"^/proc/(?:self|thread-self|\d+)(?:/|$)")
# Kernel tunables that ProtectKernelTunables= makes read-only.
_TUNABLES = ("/proc/sys/", "/sys/", "/proc/sysrq-trigger", "/proc/latency_stats", "/proc/acpi/", "/proc/timer_stats",
             "/proc/fs/", "/proc/irq/")

_LINE = re.compile(r"^(?:\[pid\s+)?(?P<pid>\d+)\]?\s+(?:\d{2}:\d{2}:\d{2}(?:\.\d+)?\s+)?(?P<rest>.*)$")
_CALL = re.compile(r"^(?P<name>[a-z_][a-z0-9_]*|\?\?\?)\((?P<args>.*)$")
_RESUMED = re.compile(r"^<\.\.\. (?P<name>[a-z_][a-z0-9_]*) resumed>(?P<args>.*)$")
_RESULT = re.compile(r"\)\s+=\s+(?P<ret>-?\d+|0x[0-9a-f]+|\?)(?:\s+(?P<errno>E[A-Z0-9]+))?[^=]*$")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
_DEV_CHAR = re.compile(r"^/dev/(?:char|block)/(\d+):(\d+)$")
_LS_NODE = re.compile(r"^([cb])\S*\s+\d+\s+\S+\s+\S+\s+(\d+),\s*(\d+)\s+.*?(\S+)\s*$")


@dataclass(frozen=True)
class Call:
    """One completed system call: its name, its arguments as printed, and whether it returned an error."""

    pid: int
    name: str
    args: str
    failed: bool
    errno: str | None = None

    def strings(self) -> list[str]:
        return [bytes(s, "utf-8").decode("unicode_escape", errors="replace") if "\\" in s else s
                for s in _STRING.findall(self.args)]


def iter_calls(text: str) -> Iterable[Call]:
    """The completed calls of ``strace -f`` output, an interrupted call joined with its resumption."""
    pending: dict[int, tuple[str, str]] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        pid, rest = int(match.group("pid")), match.group("rest")
        if rest.startswith(("---", "+++")):
            continue
        if resumed := _RESUMED.match(rest):
            name, head = pending.pop(pid, (resumed.group("name"), ""))
            rest_args = head + resumed.group("args")
        elif call := _CALL.match(rest):
            name, rest_args = call.group("name"), call.group("args")
            if rest_args.endswith("<unfinished ...>"):
                pending[pid] = (name, rest_args[: -len("<unfinished ...>")])
                continue
        else:
            continue
        result = _RESULT.search(rest_args)
        failed = bool(result and result.group("ret") == "-1")
        yield Call(pid, name, rest_args, failed, result.group("errno") if result and failed else None)
    for pid, (name, head) in pending.items():  # cut off by the end of the trace (the process was killed)
        yield Call(pid, name, head, False)


@dataclass
class TraceFacts:
    """What the server did, as far as the source shows it; None where the source does not say."""

    syscalls: Counter[str] = field(default_factory=Counter)
    paths: Counter[str] = field(default_factory=Counter)  # /dev, /proc, /sys paths touched, with counts
    devices_opened: set[str] | None = None  # device nodes opened (None: only "touched" is known)
    failed_device_opens: dict[str, str] = field(default_factory=dict)  # path -> errno
    socket_families: Counter[str] | None = None
    wx_mappings: list[str] | None = None  # mmap/mprotect asking for PROT_WRITE and PROT_EXEC at once
    exec_mprotects: list[str] | None = None  # mprotect with PROT_EXEC (what MemoryDenyWriteExecute= refuses)
    writes: list[tuple[str, str, bool]] | None = None  # (call, path, failed) for files opened to write or changed
    programs: list[str] | None = None  # every execve'd program, in order

    def devices_touched(self) -> set[str]:
        if self.devices_opened is not None:
            return set(self.devices_opened)
        return {path for path in self.paths if is_device_path(path)}

    def proc_outside_pid(self) -> list[str]:
        return sorted(p for p in self.paths if p.startswith("/proc") and not _PID_PROC.match(p) and p != "/proc")


def is_device_path(path: str) -> bool:
    return (path.startswith("/dev/") and not path.startswith(_NOT_DEVICES)
            and path not in ("/dev/char", "/dev/block", "/dev/"))


def _watched(path: str) -> bool:
    return path.startswith(("/dev/", "/proc", "/sys/")) or path in ("/dev", "/sys")


def parse_strace(text: str) -> TraceFacts:
    facts = TraceFacts(devices_opened=set(), socket_families=Counter(), wx_mappings=[], exec_mprotects=[],
                       writes=[], programs=[])
    for call in iter_calls(text):
        facts.syscalls[call.name] += 1
        if call.name in PATH_CALLS:
            paths = [s for s in call.strings() if s.startswith("/")]
            if call.name in ("execve", "execveat"):
                paths = paths[:1]  # argv and the environment are no paths
                if paths and not call.failed:
                    facts.programs.append(paths[0])
            for path in paths:
                if _watched(path):
                    facts.paths[path] += 1
            if call.name in OPEN_CALLS and paths:
                path = paths[0]
                if is_device_path(path):
                    if call.failed:
                        facts.failed_device_opens[path] = call.errno or "error"
                    else:
                        facts.devices_opened.add(path)
                if call.name == "creat" or any(flag in call.args for flag in _WRITE_FLAGS):
                    facts.writes.append((call.name, path, call.failed))
            elif call.name in MODIFYING_CALLS and paths:
                facts.writes.append((call.name, paths[-1], call.failed))
        elif call.name == "socket":
            family = call.args.split(",", 1)[0].strip()
            facts.socket_families[family] += 1
        if call.name in ("mmap", "mmap2", "mprotect", "pkey_mprotect") and "PROT_EXEC" in call.args:
            summary = f"{call.name}({call.args.split(')')[0]})" + (" failed" if call.failed else "")
            if "PROT_WRITE" in call.args:
                facts.wx_mappings.append(summary)
            if call.name != "mmap" and call.name != "mmap2":
                facts.exec_mprotects.append(summary)
    return facts


def recorded_facts(syscalls_text: str, paths_text: str) -> TraceFacts:
    """The facts an earlier run recorded: ``*-syscalls.txt`` (one name a line) and ``*-paths-opened.txt``."""
    facts = TraceFacts()
    for line in syscalls_text.splitlines():
        if line.strip() and not line.startswith("#"):
            facts.syscalls[line.strip()] += 1
    for line in paths_text.splitlines():
        match = re.match(r'^\s*(\d+)\s+"(.*)"\s*$', line)
        if match:
            facts.paths[match.group(2)] += int(match.group(1))
    return facts


def format_syscalls(facts: TraceFacts) -> str:
    return "".join(f"{name}\n" for name in sorted(facts.syscalls))


def format_paths(facts: TraceFacts) -> str:
    """``sort | uniq -c | sort -rn`` of the touched paths, quoted, as the recorded fixture is."""
    rows = sorted(facts.paths.items(), key=lambda item: (item[1], item[0]), reverse=True)
    return "".join(f'{count:7d} "{path}"\n' for path, count in rows)


# ---- device numbers -------------------------------------------------------------------------------------------

def parse_dev_nodes(text: str) -> dict[str, tuple[int, int]]:
    """``ls -l /dev/nvidia* /dev/nvidia-caps`` -> node path -> (major, minor); nodes inside a listed folder too."""
    nodes: dict[str, tuple[int, int]] = {}
    folder = "/dev"
    for line in text.splitlines():
        if line.endswith(":") and line.startswith("/"):
            folder = line[:-1]
            continue
        match = _LS_NODE.match(line)
        if match:
            name = match.group(4)
            path = name if name.startswith("/") else f"{folder}/{name}"
            nodes[path] = (int(match.group(2)), int(match.group(3)))
    return nodes


def device_number(path: str, nodes: Mapping[str, tuple[int, int]]) -> tuple[int, int] | None:
    if path in nodes:
        return nodes[path]
    match = _DEV_CHAR.match(path)
    return (int(match.group(1)), int(match.group(2))) if match else None


def node_name(path: str, nodes: Mapping[str, tuple[int, int]]) -> str:
    """``/dev/char/195:255`` -> ``/dev/nvidiactl`` when the listing knows the number; else the path."""
    number = device_number(path, nodes)
    if number is not None and path not in nodes:
        for node, node_number in nodes.items():
            if node_number == number:
                return node
    return path


# ---- the checks -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    """One verdict: ``pass``, ``fail``, ``note`` (a fact worth knowing, no verdict) or ``skip`` (not recorded)."""

    name: str
    status: str
    detail: str

    def line(self) -> str:
        return f"{self.status.upper():<4} {self.name}: {self.detail}"


def _list(items: Iterable[str], limit: int = 12) -> str:
    items = list(items)
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def check_syscalls(facts: TraceFacts, policy: UnitPolicy, resolved: SyscallPolicy | None) -> Check:
    if resolved is None:
        return Check("system calls", "skip", "the unit sets no SystemCallFilter=")
    refused = sorted(name for name in facts.syscalls if not resolved.allowed(name))
    where = f"SystemCallFilter={' / '.join(policy.syscall_filter)}"
    if refused:
        return Check("system calls", "fail", f"{len(refused)} of {len(facts.syscalls)} refused by {where}: "
                     f"{_list(refused)}")
    return Check("system calls", "pass", f"all {len(facts.syscalls)} allowed by {where}")


def check_devices(facts: TraceFacts, policy: UnitPolicy, nodes: Mapping[str, tuple[int, int]]) -> Check:
    if policy.device_policy not in ("closed", "strict"):
        return Check("devices", "skip", f"DevicePolicy={policy.device_policy or 'auto'}: every device is open")
    allowed_paths = [path for path, _access in policy.device_allow]
    if policy.device_policy == "closed":
        allowed_paths += list(CLOSED_POLICY_DEVICES)
    allowed_numbers = {n for n in (device_number(p, nodes) for p in allowed_paths) if n is not None}
    touched = facts.devices_touched()
    refused = []
    for path in sorted(touched):
        number = device_number(path, nodes)
        if path in allowed_paths or path.startswith("/dev/pts/") or (number is not None and number in allowed_numbers):
            continue
        refused.append(path if node_name(path, nodes) == path else f"{path} ({node_name(path, nodes)})")
    how = "opened" if facts.devices_opened is not None else "touched"
    names = sorted({node_name(path, nodes) for path in touched})
    if refused:
        return Check("devices", "fail", f"{how} outside DeviceAllow=: {_list(refused)} (allowed: {_list(allowed_paths)})")
    unused = [path for path in (p for p, _ in policy.device_allow) if path not in names]
    detail = f"{how} {_list(names) or 'none'}, all in DeviceAllow="
    if unused:
        detail += f"; allowed but never opened: {_list(unused)}"
    if facts.failed_device_opens:
        detail += "; failed opens: " + _list(f"{p} ({e})" for p, e in sorted(facts.failed_device_opens.items()))
    return Check("devices", "pass", detail)


def check_families(facts: TraceFacts, policy: UnitPolicy) -> Check:
    if facts.socket_families is None:
        return Check("socket families", "skip", "the recorded trace does not list socket() calls")
    families = sorted(facts.socket_families)
    if not policy.address_families:
        return Check("socket families", "skip", f"no RestrictAddressFamilies= (used: {_list(families)})")
    if policy.address_families[0] == "~":
        refused = [f for f in families if f in policy.address_families[1:]]
    else:
        refused = [f for f in families if f not in policy.address_families]
    where = "RestrictAddressFamilies=" + " ".join(policy.address_families)
    if refused:
        return Check("socket families", "fail", f"{_list(refused)} refused by {where}")
    return Check("socket families", "pass", f"{_list(families) or 'none'} within {where}")


def check_write_execute(facts: TraceFacts, policy: UnitPolicy) -> Check:
    if facts.wx_mappings is None or facts.exec_mprotects is None:
        return Check("write+execute memory", "skip", "the recorded trace does not list mappings")
    found = facts.wx_mappings + [m for m in facts.exec_mprotects if m not in facts.wx_mappings]
    if policy.memory_deny_write_execute:
        if found:
            return Check("write+execute memory", "fail", f"MemoryDenyWriteExecute=yes refuses {len(found)} calls: "
                         f"{_list(found, 4)}")
        return Check("write+execute memory", "pass", "no writable+executable mapping and no mprotect(PROT_EXEC), "
                     "as MemoryDenyWriteExecute=yes requires")
    if found:
        return Check("write+execute memory", "note", f"{len(found)} calls MemoryDenyWriteExecute=yes would refuse: "
                     f"{_list(found, 4)}")
    return Check("write+execute memory", "note", "no writable+executable mapping and no mprotect(PROT_EXEC): "
                 "MemoryDenyWriteExecute=yes would not stop this server")


def check_proc(facts: TraceFacts, policy: UnitPolicy) -> Check:
    outside = facts.proc_outside_pid()
    if policy.proc_subset == "pid":
        if outside:
            return Check("/proc", "fail", f"ProcSubset=pid hides what the server read: {_list(outside, 6)}")
        return Check("/proc", "pass", "only its own /proc entries, as ProcSubset=pid allows")
    if outside:
        return Check("/proc", "note", f"reads beyond its own pid (ProcSubset=pid would hide them): {_list(outside, 6)}")
    return Check("/proc", "note", "only its own /proc entries: ProcSubset=pid would not stop this server")


def check_writes(facts: TraceFacts, policy: UnitPolicy) -> Check:
    if facts.writes is None:
        return Check("writes", "skip", "the recorded trace does not list the files opened for writing")
    tunables = [f"{call} {path}" for call, path, failed in facts.writes
                if not failed and path.startswith(_TUNABLES)]
    if policy.protect_kernel_tunables and tunables:
        return Check("writes", "fail", f"ProtectKernelTunables=yes makes these read-only: {_list(tunables, 6)}")
    done = sorted({f"{call} {path}" + (" (failed)" if failed else "") for call, path, failed in facts.writes
                   if path.startswith("/")})
    return Check("writes", "note", f"files written or changed: {_list(done, 8) or 'none'}")


def check_programs(facts: TraceFacts) -> Check:
    if facts.programs is None:
        return Check("programs", "skip", "the recorded trace does not list execve calls")
    others = facts.programs[1:]
    if others:
        return Check("programs", "note", f"the server ran {_list(others)} (NoNewPrivileges=yes keeps a setuid helper "
                     "such as nvidia-modprobe from working: the unit's boot unit must make the nodes first)")
    return Check("programs", "pass", "the server ran no other program")


def check_trace(facts: TraceFacts, policy: UnitPolicy, resolved: SyscallPolicy | None,
                nodes: Mapping[str, tuple[int, int]]) -> list[Check]:
    return [check_syscalls(facts, policy, resolved), check_devices(facts, policy, nodes),
            check_families(facts, policy), check_write_execute(facts, policy), check_proc(facts, policy),
            check_writes(facts, policy), check_programs(facts)]
