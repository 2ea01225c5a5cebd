#!/usr/bin/python
from __future__ import annotations

DOCUMENTATION = r"""
---
module: box_manifest
short_description: Record what a full run left on a box, and later say in one call whether the box still matches it
description:
  - The first and last task of C(playbooks/site.yml) on Linux boxes. At the end of a full run without failures,
    C(state=record) writes a record of everything the run's tasks managed, as it is on the box then (the
    C(v100box.llm.manifest) callback noted what that is) and the digest of the run's inputs.
  - The next run's first task, C(state=check), compares the box with that record in one call; when nothing differs
    and every server answers C(/health), the same call runs the checks of C(v100box.llm.llama_api_check) on each
    server of C(servers) (the run's verdict rests on them, as after a full run) and the play ends the host. Any
    difference, a missing or old record, other inputs, or C(v100box_full_run) means the full run, and the record is
    removed first (a full run that fails leaves none, so the run after it is a full one too).
  - Files with content (templates, copies, downloads, account files) by SHA-256 (size, mtime and inode above
    64 MiB), mode and owner; directories and attribute-only files by mode and owner; links by target; unpacked
    trees by every member's path, size, mode and mtime; model files by size, mtime, inode and owner beside their
    C(.verified) record; units by load, unit-file and active state, drop-ins and whether systemd needs a reload;
    packages by version; accounts by ids, home and shell; ufw and firewalld by their rule listings.
  - Linux only; the action plugin adds the digest of the inputs and, for a record, what the callback noted. For a check
    on a host whose facts are not cached, it first gathers the facts the roles read (the setup module's
    C(distribution) and C(pkg_mgr) subsets) and returns them as the host's facts.
options:
  state:
    description: C(record) after a full run, C(check) before one.
    type: str
    choices: [check, record]
    required: true
  path:
    description: Where the record lives on the box (root only).
    type: path
    default: /var/lib/v100box/converged.json
  digest:
    description: The digest of the run's inputs (set by the action plugin).
    type: str
    required: true
  inputs:
    description: Each input's name with the hash of its value (set by the action plugin), so that a check can say
      which inputs differ.
    type: dict
    default: {}
  managed:
    description: What the run's tasks managed (set by the action plugin; C(state=record) only).
    type: dict
    default: {}
  full:
    description: With C(state=check), skip the comparison and say the run is a full one (C(--full)).
    type: bool
    default: false
  max_age_s:
    description: A record older than this many seconds is out of date (a full run covers what no record can).
    type: int
    default: 604800
  health_timeout_s:
    description: Seconds to wait for each server's C(/health).
    type: int
    default: 5
  servers:
    description:
      - With C(state=check), the checks of C(v100box.llm.llama_api_check) to run when the box matches its record, in
        this same module run (a converged box then costs one module run, not two), one item a server (and one more
        for each other model of an on-demand router), as C(v100box.llm.llama_verify)'s C(_llama_verify_checks)
        lists them.
      - Each item has C(base_url), C(model), C(first) (the server's own model, not another of a router's), the
        C(instance) it checks and C(api_key_file), the server's key file read when C(api_key) is empty (none is sent
        when the file is missing, as a server served without a key has none).
      - A box that differs from its record checks nothing here (its full run checks the servers at its end).
    type: list
    elements: dict
    default: []
  api_key:
    description: The key sent to every server of C(servers); empty, each server's C(api_key_file).
    type: str
    default: ''
  prompt:
    description: The prompt of each server's turns (as C(llama_api_check)'s).
    type: str
    default: Say hello in five words.
  max_tokens:
    description: Tokens asked for in each turn.
    type: int
    default: 16
  timeout:
    description: Seconds to wait for each of a server's answers.
    type: int
    default: 120
  certify:
    description: Also the certification's checks, for each server's own model (as C(llama_api_check)'s C(certify)).
    type: bool
    default: false
  throughput_max_tokens:
    description: With C(certify), the tokens each throughput request generates.
    type: int
    default: 64
  throughput_runs:
    description: With C(certify), how many throughput requests are made.
    type: int
    default: 3
author: v100box maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Compare the box with the record of its last full run
  v100box.llm.box_manifest:
    state: check
  register: __site_converged
"""

RETURN = r"""
converged:
  description: Whether the box matches its record and its inputs (C(state=check)).
  type: bool
  returned: always
reasons:
  description: What differs, at most ten lines (C(state=check)).
  type: list
  elements: str
  returned: always
entries:
  description: How many things the record holds.
  type: int
  returned: always
servers:
  description: With C(state=check) on a converged box, each item of C(servers) as C(check) with the fields
    C(llama_api_check) returns for it (C(health), C(served_ids), C(openai), C(anthropic), C(auth), ...). The task fails
    when a check fails, saying which server answered what.
  type: list
  elements: dict
  returned: when the box matches its record
"""

import grp
import hashlib
import json
import os
import pwd
import shutil
import stat
import tempfile
import time
import urllib.error

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.v100box.llm.plugins.module_utils.api_check import SETTINGS, server_key, settings_problem
from ansible_collections.v100box.llm.plugins.module_utils.api_check import check as check_server
from ansible_collections.v100box.llm.plugins.module_utils.fetch import open_url
from ansible_collections.v100box.llm.plugins.module_utils.systemd import show_properties

VERSION = 1
BIG = 64 * 1024 * 1024  # files larger than this are recorded by size, mtime and inode, not hashed


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _home_path(path):
    """``~account/relative/path`` (a file account_files wrote in an account's home) as an absolute path; an
    account that no longer exists leaves the path as it is (so the file reads as absent)."""
    if not path.startswith("~"):
        return path
    account, _sep, rest = path[1:].partition("/")
    try:
        return os.path.join(pwd.getpwnam(account).pw_dir, rest)
    except KeyError:
        return path


def _file(path, kind):
    path = _home_path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return {"type": "absent"}
    except OSError as exc:
        return {"type": "unreadable", "error": exc.strerror}
    entry = {"mode": stat.S_IMODE(info.st_mode), "uid": info.st_uid, "gid": info.st_gid}
    if stat.S_ISLNK(info.st_mode):
        entry.update(type="link", target=os.readlink(path))
        return entry
    if stat.S_ISDIR(info.st_mode):
        entry["type"] = "directory"
        if kind == "tree":
            entry["members"] = _tree(path)
        return entry
    entry["type"] = "file" if stat.S_ISREG(info.st_mode) else "other"
    if kind == "large" or (kind == "content" and info.st_size > BIG):
        entry.update(size=info.st_size, mtime_ns=info.st_mtime_ns, inode=info.st_ino,
                     marker=os.path.exists(path + ".verified"))
    elif kind == "content" and entry["type"] == "file":
        entry["sha256"] = _sha256(path)
    return entry


def _tree(root):
    members = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            full = os.path.join(folder, name)
            info = os.lstat(full)
            members.append([os.path.relpath(full, root), info.st_size if not stat.S_ISDIR(info.st_mode) else 0,
                            info.st_mode, info.st_mtime_ns if stat.S_ISREG(info.st_mode) else 0,
                            os.readlink(full) if stat.S_ISLNK(info.st_mode) else ""])
    return hashlib.sha256(json.dumps(members).encode()).hexdigest()


_UNIT_PROPERTIES = ("Id", "LoadState", "ActiveState", "UnitFileState", "NeedDaemonReload", "DropInPaths",
                    "FragmentPath")


def _units(module, names):
    if not names:
        return {}
    rc, out, err = module.run_command(["systemctl", "show", "--property", ",".join(_UNIT_PROPERTIES), "--"]
                                      + list(names))
    if rc != 0:
        return {name: {"error": err.strip() or f"systemctl show exited {rc}"} for name in names}
    return {name: {key: block.get(key, "") for key in _UNIT_PROPERTIES if key != "Id"}
            for name, block in zip(names, show_properties(out))}


def _packages(module, names):
    if not names:
        return {}
    found = dict.fromkeys(names, "missing")
    if shutil.which("dpkg-query"):
        _rc, out, _err = module.run_command(["dpkg-query", "--show", "--showformat",
                                             "${Package}\t${Version}\t${db:Status-Status}\n", "--"] + list(names))
        for line in out.splitlines():
            parts = line.split("\t")
            if len(parts) == 3 and parts[0] in found:
                found[parts[0]] = parts[1] if parts[2] == "installed" else parts[2]
    elif shutil.which("rpm"):
        _rc, out, _err = module.run_command(["rpm", "--query", "--queryformat", "%{NAME}\t%{VERSION}-%{RELEASE}\n"]
                                            + list(names))
        for line in out.splitlines():
            parts = line.split("\t")
            if len(parts) == 2 and parts[0] in found:
                found[parts[0]] = parts[1]
    return found


def _account(name):
    kind, account = name.split(":", 1)
    try:
        if kind == "user":
            entry = pwd.getpwnam(account)
            return [entry.pw_uid, entry.pw_gid, entry.pw_dir, entry.pw_shell]
        entry = grp.getgrnam(account)
        return [entry.gr_gid, sorted(entry.gr_mem)]
    except KeyError:
        return None


_FIREWALL_LISTINGS = {"ufw": ["ufw", "status", "verbose"], "firewalld": ["firewall-cmd", "--list-all-zones"]}


def _firewall(module, tool):
    argv = _FIREWALL_LISTINGS.get(tool)
    if not argv or not shutil.which(argv[0]):
        return None
    rc, out, _err = module.run_command(argv)
    return hashlib.sha256(f"{rc}\n{out}".encode()).hexdigest()


def read_box(module, managed):
    """What the box has now of everything ``managed`` names, in the record's shape."""
    files = managed.get("files") or {}
    return {
        "files": {path: _file(path, kind) for path, kind in sorted(files.items())},
        "units": _units(module, sorted(managed.get("units") or {})),
        "packages": _packages(module, sorted(managed.get("packages") or {})),
        "accounts": {name: _account(name) for name in sorted(managed.get("accounts") or {})},
        "firewall": {tool: _firewall(module, tool) for tool in sorted(managed.get("firewall") or {})},
    }


def _health(base_url, timeout):
    try:
        with open_url(base_url.rstrip("/") + "/health", timeout=timeout, validate_certs=False) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _unit_differs(name, recorded, found):
    problems = []
    for key in ("LoadState", "UnitFileState", "DropInPaths", "FragmentPath"):
        if found.get(key) != recorded.get(key):
            problems.append(f"unit {name}: {key} is {found.get(key)!r}, was {recorded.get(key)!r}")
    if recorded.get("ActiveState") == "active" and found.get("ActiveState") != "active":
        problems.append(f"unit {name} is {found.get('ActiveState') or 'unknown'}, was active")
    if found.get("NeedDaemonReload") == "yes":
        problems.append(f"unit {name}: systemd runs an older copy of its unit file")
    return problems


def compare(record, found):
    """Lines saying what differs between the record and what the box has now (empty: nothing)."""
    problems = []
    for path, entry in record["state"]["files"].items():
        now = found["files"].get(path)
        if now != entry:
            fields = sorted(key for key in set(entry) | set(now or {}) if (now or {}).get(key) != entry.get(key))
            problems.append(f"{path}: {', '.join(fields)} changed" if now and now.get("type") == entry.get("type")
                            else f"{path} is {(now or {}).get('type', 'unknown')}, was {entry.get('type')}")
    for name, entry in record["state"]["units"].items():
        problems += _unit_differs(name, entry, found["units"].get(name) or {})
    for kind in ("packages", "accounts", "firewall"):
        for name, entry in record["state"][kind].items():
            if found[kind].get(name) != entry:
                problems.append(f"{kind[:-1] if kind != 'firewall' else 'firewall'} {name}: now "
                                f"{found[kind].get(name)!r}, was {entry!r}")
    return problems


def check(module, params):
    try:
        with open(params["path"]) as handle:
            record = json.load(handle)
    except FileNotFoundError:
        return False, ["no record of a full run on this box"], 0
    except (OSError, ValueError) as exc:
        return False, [f"the record {params['path']} cannot be read: {exc}"], 0
    if record.get("version") != VERSION:
        return False, ["the record was written by another version of box_manifest"], 0
    entries = sum(len(record["state"][kind]) for kind in record["state"])
    if record.get("digest") != params["digest"]:
        before, now = record.get("inputs") or {}, params["inputs"]
        names = sorted(name for name in set(before) | set(now) if before.get(name) != now.get(name))
        said = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        return False, [f"the inputs differ from the last full run's: {said or 'inventory, collection or Ansible'}"], \
            entries
    age = time.time() - float(record.get("recorded_at", 0))
    if age > params["max_age_s"] or age < -300:
        return False, [f"the last full run was {age / 86400:.1f} days ago"], entries
    problems = compare(record, read_box(module, record["managed"]))
    for base_url in record["managed"].get("servers") or {}:
        if not _health(base_url, params["health_timeout_s"]):
            problems.append(f"{base_url}/health does not answer 200")
    return not problems, problems[:10], entries


def check_servers(module, params):
    """``llama_api_check``'s checks of each item of ``servers``; returns (answers, problems)."""
    answers, problems = [], []
    for server in params["servers"]:
        where = server["base_url"] + ("" if server.get("first", True) else f" ({server['model']})")
        key, problem = server_key(params["api_key"], server.get("api_key_file") or "", optional=True)
        if key:
            module.no_log_values.add(key)
        if problem:
            answers.append({"check": server, "health": "unknown"})
            problems.append(f"{where}: {problem}")
            continue
        answer, found = check_server(server["base_url"], server["model"], key, params["prompt"], params["max_tokens"],
                                     params["timeout"], certify_box=params["certify"] and server.get("first", True),
                                     throughput_max_tokens=params["throughput_max_tokens"],
                                     throughput_runs=params["throughput_runs"])
        answers.append({"check": server, **answer})
        problems += [f"{where}: {'; '.join(found)}"] if found else []
    return answers, problems


def _merged(path, noted):
    """What this run noted, with what earlier full runs noted and this one skipped (an engine already unpacked, a
    model already downloaded) while it is still on the box."""
    try:
        with open(path) as handle:
            earlier = json.load(handle)
    except (OSError, ValueError):
        return noted
    if earlier.get("version") != VERSION:
        return noted
    merged = {kind: dict(entries) for kind, entries in noted.items()}
    for kind, entries in (earlier.get("managed") or {}).items():
        for name, detail in entries.items():
            if kind == "files" and detail != "absent" and not os.path.lexists(_home_path(name)):
                continue  # gone, and no task of this run made it
            merged.setdefault(kind, {}).setdefault(name, detail)
    return merged


def record(module, params):
    managed = _merged(params["path"], params["managed"])
    state = read_box(module, managed)
    folder = os.path.dirname(params["path"])
    os.makedirs(folder, mode=0o700, exist_ok=True)
    data = {"version": VERSION, "digest": params["digest"], "inputs": params["inputs"], "recorded_at": time.time(),
            "managed": managed,
            "state": state}
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=".converged-")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, sort_keys=True)
        os.chmod(temporary, 0o600)
        os.replace(temporary, params["path"])
    except BaseException:
        os.unlink(temporary)
        raise
    return sum(len(value) for value in state.values())


def main():
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", choices=["check", "record"], required=True),
            path=dict(type="path", default="/var/lib/v100box/converged.json"),
            digest=dict(type="str", required=True, no_log=False),
            inputs=dict(type="dict", default={}),
            managed=dict(type="dict", default={}),
            full=dict(type="bool", default=False),
            max_age_s=dict(type="int", default=604800),
            health_timeout_s=dict(type="int", default=5),
            servers=dict(type="list", elements="dict", default=[]),
            **{name: dict(spec) for name, spec in SETTINGS.items()},  # the servers' checks' settings
        ),
        supports_check_mode=True,
    )
    params = module.params
    problem = settings_problem(params)
    if problem:  # as llama_api_check refuses them after a full run
        module.fail_json(msg=problem)
    if params["state"] == "check":
        if params["full"]:
            converged, reasons, entries = False, ["a full run was asked for"], 0
        else:
            converged, reasons, entries = check(module, params)
        if not converged and not module.check_mode and os.path.exists(params["path"]):
            # A full run follows; until it ends without failures, no record vouches for this box.
            os.unlink(params["path"])
        if not converged:
            module.exit_json(changed=False, converged=False, reasons=reasons, entries=entries)
        # As after a full run, the run's verdict rests on the servers' answers now.
        answers, problems = check_servers(module, params)
        if problems:
            module.fail_json(msg="; ".join(problems), converged=True, reasons=[], entries=entries, servers=answers)
        module.exit_json(changed=False, converged=True, reasons=[], entries=entries, servers=answers)
    if module.check_mode:
        module.exit_json(changed=False, converged=False, reasons=[], entries=0)
    if not params["managed"]:  # nothing noted (the callback is off): no record, so the next run is a full one
        if os.path.exists(params["path"]):
            os.unlink(params["path"])
        module.exit_json(changed=False, converged=False, reasons=[], entries=0, msg="nothing was noted to record")
    entries = record(module, params)
    module.exit_json(changed=False, converged=False, reasons=[], entries=entries)


if __name__ == "__main__":
    main()
