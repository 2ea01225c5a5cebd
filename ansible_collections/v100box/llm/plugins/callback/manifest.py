"""Notes, per host, what each task of a run manages on the box, for the box's record of a full run.

The last task of playbooks/site.yml (``v100box.llm.box_manifest`` with ``state: record``) writes this list on the
box with what is there at the end of the run: each file's checksum, mode and owner, each link's target, each
unit's state, each package's version, each account, the firewall's rules, each server's address. The next run's
first task compares the box with that record (``state: check``) and ends the host when nothing differs.

This callback runs in ansible-playbook's main process; the record task's action plugin runs in a worker forked
after every earlier result was handled here, so it reads ``MANAGED`` from the copy of this module it inherited.
Without this callback the record task records nothing (and removes an older record): the next run is a full one.
"""

from __future__ import annotations

DOCUMENTATION = r"""
---
name: manifest
type: aggregate
short_description: Note what each task manages on each box, for box_manifest's record
description:
  - Collects, per host, the paths, units, packages, accounts, firewall tools and servers that the run's tasks
    managed, from their results.
  - Read by the C(v100box.llm.box_manifest) record task at the end of C(playbooks/site.yml).
requirements:
  - enabled in C(callbacks_enabled) (the project's ansible.cfg enables it)
author: v100box maintainers (!UNKNOWN)
"""

from typing import Any

from ansible.plugins.callback import CallbackBase

# What the record task reads: host -> kind -> {name: detail}. Kinds: files (path -> "content" | "attributes" |
# "directory" | "link" | "absent" | "tree"), units, packages, accounts (user or group names), firewall (tool
# names), servers (base URL -> model id).
MANAGED: dict[str, dict[str, dict[str, Any]]] = {}
# Hosts on which a task failed (even one whose failure was ignored or rescued): no record is written for them.
FAILED: set[str] = set()

_CONTENT = {"template", "copy", "get_url"}  # modules whose files' content is managed
_PACKAGES = {"apt", "package", "dnf", "yum"}
_ACCOUNTS = {"user", "group"}
_FIREWALL = {"ufw": "ufw", "firewalld": "firewalld"}


def _short(action: str) -> str:
    return action.rsplit(".", 1)[-1]


def _names(value: Any) -> list[str]:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (list, tuple)):
        return [str(part) for part in value if part]
    return []


def note(host: str, action: str, result: dict[str, Any], task_args: dict[str, Any]) -> None:
    """Add what one task result (one loop item, or a task without a loop) says it manages on ``host``.

    A result hidden by ``no_log`` says nothing: the task's own arguments (templated, for a loop item) stand in."""
    if result.get("skipped") or result.get("failed"):
        return
    kind = _short(action)
    args = (result.get("invocation") or {}).get("module_args") or {}
    if result.get("censored") or not args:
        args = {key: value for key, value in (task_args or {}).items()
                if not (isinstance(value, str) and "{{" in value)}
    managed = MANAGED.setdefault(host, {})
    files = managed.setdefault("files", {})
    path = result.get("dest") or result.get("path") or args.get("dest") or args.get("path")
    state = result.get("state") or args.get("state")
    if kind in _CONTENT and path:
        files[str(path)] = "content" if state in (None, "file") else state
    elif kind == "file" and path:
        files[str(path)] = {"file": "attributes", "touch": "attributes", "hard": "attributes"}.get(state, state)
    elif kind == "account_files" and args.get("account"):
        home = f"~{args['account']}"  # box_manifest finds the home on the box
        for folder in args.get("directories") or []:
            files[f"{home}/{folder}"] = "directory"
        secret = args.get("secret_files")
        for name in [*(item.get("path") for item in args.get("files") or [] if isinstance(item, dict)),
                     *(secret if isinstance(secret, dict) else {})]:
            if name:
                files[f"{home}/{name}"] = "content"
        for name in args.get("check") or []:
            files.setdefault(f"{home}/{name}", "attributes")
    elif kind == "safe_unpack" and path:
        files[str(path)] = "tree"
    elif kind == "gguf_download" and path:
        files[str(path)] = "large"
    elif kind == "command" and args.get("creates"):
        files[str(args["creates"])] = "attributes"
    elif kind == "command" and _moved(args):
        source, target = _moved(args)
        files[target] = files.pop(source, "tree")
        files[source] = "absent"
    elif kind == "systemd_service" and (result.get("name") or args.get("name")):
        managed.setdefault("units", {})[str(result.get("name") or args["name"])] = True
    elif kind in _PACKAGES:
        for name in _names(args.get("name")):
            if args.get("state") not in ("absent", "removed"):
                managed.setdefault("packages", {})[name.split("=")[0]] = True
    elif kind in _ACCOUNTS and (result.get("name") or args.get("name")):
        managed.setdefault("accounts", {})[f"{kind}:{result.get('name') or args['name']}"] = True
    elif kind in _FIREWALL:
        managed.setdefault("firewall", {})[_FIREWALL[kind]] = True
    elif kind == "llama_api_check" and args.get("base_url") and result.get("health") == "ok":
        managed.setdefault("servers", {})[str(args["base_url"])] = str(args.get("model") or "")


def _moved(args: dict[str, Any]) -> tuple[str, str] | None:
    """``mv -T SOURCE TARGET`` (how llama_engine puts an unpacked version in place): the two paths."""
    argv = args.get("argv") or []
    if len(argv) == 4 and argv[0] == "mv" and argv[1] == "-T":
        return str(argv[2]), str(argv[3])
    return None


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "v100box.llm.manifest"
    CALLBACK_NEEDS_ENABLED = True

    def v2_runner_on_ok(self, result) -> None:
        if "results" in result._result:  # a loop: its items came one by one (v2_runner_item_on_ok)
            return
        note(result._host.get_name(), result._task.resolved_action or result._task.action, result._result,
             result._task.args)

    def v2_runner_item_on_ok(self, result) -> None:
        note(result._host.get_name(), result._task.resolved_action or result._task.action, result._result,
             result._task.args)

    def v2_runner_on_failed(self, result, ignore_errors=False) -> None:
        FAILED.add(result._host.get_name())

    def v2_runner_item_on_failed(self, result) -> None:
        FAILED.add(result._host.get_name())

    def v2_runner_on_unreachable(self, result) -> None:
        FAILED.add(result._host.get_name())
