#!/usr/bin/python
from __future__ import annotations

DOCUMENTATION = r"""
---
module: account_files
short_description: Write and read files in an account's home as that account, never through its links
description:
  - The module runs as root, but every folder, file and read under the account's home is done by a child
    process that has dropped to the account's user and groups. Whatever the account arranged in its own home
    (a link to C(/usr/local/bin), to C(/etc/llama/keys) or to a root-only file), the kernel then grants the
    child no more than it grants the account.
  - Every path component below the home is opened without following links. A component that is a symbolic
    link, is not a folder (or for a file, not a regular file), or is not owned by the account is refused with
    one line naming the path; nothing else is written then.
  - Files are written to a temporary file in the same folder and renamed over the old one, so a reader never
    sees half a file and a link at the destination is replaced, never followed.
  - Linux only. Connected as the account itself, no change of user is needed; as another unprivileged user the
    module refuses.
options:
  account:
    description: The account whose home is written.
    type: str
    required: true
  directories:
    description: Folders relative to the home to create (mode 0700) when missing, and to check.
    type: list
    elements: str
    default: []
  files:
    description: Files relative to the home to write, each C(path), C(content) and C(mode) (default 0600).
    type: list
    elements: dict
    default: []
  secret_files:
    description: Files relative to the home to write with mode 0600, by path; their contents never appear in
      the module's answer or invocation.
    type: dict
    default: {}
  check:
    description: Files relative to the home that must not be links, other kinds of file or another owner's.
    type: list
    elements: str
    default: []
  read:
    description: Files relative to the home to read (the answer has C(null) for a missing one).
    type: list
    elements: str
    default: []
author: v100box maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Give the account its key
  v100box.llm.account_files:
    account: alice
    directories: [.config/v100-llm-box/keys]
    secret_files:
      .config/v100-llm-box/keys/box.key: "{{ key }}\n"
"""

RETURN = r"""
changed_paths:
  description: The paths (relative to the home) created or rewritten.
  type: list
  returned: always
contents:
  description: By path in C(read), the file's text, or null when it does not exist.
  type: dict
  returned: always
"""

import errno
import json
import os
import pwd
import stat

from ansible.module_utils.basic import AnsibleModule

MAX_READ_BYTES = 4 * 1024 * 1024
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Refused(Exception):
    """A path the module will not write through; the message names it."""


def components(relative):
    parts = [part for part in relative.split("/") if part not in ("", ".")]
    if not parts or ".." in parts or relative.startswith("/"):
        raise Refused(f"{relative!r} is not a path inside the home")
    return parts


class Home:
    """Open folders of one home, by relative path, each opened without following a link."""

    def __init__(self, home, uid, check_mode):
        self.home = home
        self.uid = uid
        self.check_mode = check_mode
        self.changed = []
        self.fds = {}
        fd = os.open(home, DIR_FLAGS & ~os.O_NOFOLLOW)
        self._owned(fd, home)
        self.fds[""] = fd

    def shown(self, relative):
        return f"{self.home.rstrip('/')}/{relative}" if relative else self.home

    def _owned(self, fd, shown):
        info = os.fstat(fd)
        if info.st_uid != self.uid:
            raise Refused(f"{shown} belongs to uid {info.st_uid}, not to the account: give it to the account or remove it")
        return info

    def folder(self, relative, create, mode=0o700):
        """The fd of a folder below the home (None in check mode when it does not exist yet)."""
        parts = components(relative) if relative else []
        path = ""
        fd = self.fds[""]
        for part in parts:
            path = f"{path}/{part}" if path else part
            if path in self.fds:
                fd = self.fds[path]
                continue
            if fd is None:  # check mode: a parent that would have been created
                self.fds[path] = None
                continue
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    return None
                self.changed.append(path)
                if self.check_mode:
                    self.fds[path] = None
                    fd = None
                    continue
                os.mkdir(part, mode, dir_fd=fd)
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise Refused(self._why_not_folder(fd, part, path, exc)) from None
            self._owned(child, self.shown(path))
            self.fds[path] = child
            fd = child
        return fd

    def _why_not_folder(self, parent, part, path, exc):
        kind = "not a folder"
        try:
            if stat.S_ISLNK(os.stat(part, dir_fd=parent, follow_symlinks=False).st_mode):
                kind = "a symbolic link"
        except OSError:
            pass
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) or kind == "a symbolic link":
            return (f"{self.shown(path)} is {kind}: agent_clients writes only into real folders the account owns; "
                    "remove it and run again")
        return f"{self.shown(path)}: {exc.strerror}"

    def open_file(self, relative):
        """(folder fd, name, fd of the existing file or None); refuses links, other kinds and other owners."""
        parts = components(relative)
        parent = self.folder("/".join(parts[:-1]), create=False)
        name = parts[-1]
        if parent is None:
            return None, name, None
        try:
            fd = os.open(name, FILE_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            return parent, name, None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise Refused(f"{self.shown(relative)} is a symbolic link: agent_clients never writes or reads "
                              "through a link in the account's home; remove it and run again") from None
            raise Refused(f"{self.shown(relative)}: {exc.strerror}") from None
        info = self._owned(fd, self.shown(relative))
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise Refused(f"{self.shown(relative)} is not a regular file: remove it and run again")
        return parent, name, fd

    def read(self, relative):
        _parent, _name, fd = self.open_file(relative)
        if fd is None:
            return None
        with os.fdopen(fd, "rb") as handle:
            data = handle.read(MAX_READ_BYTES + 1)
        if len(data) > MAX_READ_BYTES:
            raise Refused(f"{self.shown(relative)} is larger than {MAX_READ_BYTES} bytes: not read")
        return data.decode("utf-8", errors="replace")

    def write(self, relative, content, mode):
        data = content.encode()
        parent, name, fd = self.open_file(relative)
        if fd is not None:
            with os.fdopen(fd, "rb") as handle:
                same = handle.read(len(data) + 1) == data and stat.S_IMODE(os.fstat(handle.fileno()).st_mode) == mode
            if same:
                return
        self.changed.append(relative)
        if self.check_mode or parent is None:
            return
        temp = f".{name}.{os.getpid()}.tmp"
        out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
        try:
            with os.fdopen(out, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fchmod(handle.fileno(), mode)
                os.fsync(handle.fileno())
            os.replace(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            try:
                os.unlink(temp, dir_fd=parent)
            except OSError:
                pass
            raise


def work(params, home, uid, check_mode):
    """Everything the module does, in the process that already runs as the account."""
    tree = Home(home, uid, check_mode)
    for relative in params["directories"]:
        tree.folder(relative, create=True)
    secrets = [{"path": path, "content": content, "mode": "0600"} for path, content in params["secret_files"].items()]
    for relative in params["check"] + [item["path"] for item in params["files"] + secrets]:
        _parent, _name, fd = tree.open_file(relative)
        if fd is not None:
            os.close(fd)
    contents = {relative: tree.read(relative) for relative in params["read"]}
    for item in params["files"] + secrets:
        tree.write(item["path"], item["content"], int(str(item.get("mode") or "0600"), 8))
    return {"changed_paths": tree.changed, "contents": contents}


def as_account(account, check_mode, params):
    """Run work() as the account: in a child that dropped root's rights, or here when already the account."""
    entry = pwd.getpwnam(account)
    if os.geteuid() == entry.pw_uid:
        return work(params, entry.pw_dir, entry.pw_uid, check_mode)
    if os.geteuid() != 0:
        raise Refused(f"cannot write into {account}'s home as uid {os.geteuid()}: connect as root (become) or as {account}")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the account's groups, group and user, then the work
        os.close(read_end)
        code = 0
        try:
            os.setgroups(os.getgrouplist(account, entry.pw_gid))
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            answer = {"ok": work(params, entry.pw_dir, entry.pw_uid, check_mode)}
        except Refused as exc:
            answer = {"refused": str(exc)}
        except OSError as exc:
            answer = {"refused": f"{exc.filename or entry.pw_dir}: {exc.strerror}"}
        except BaseException as exc:  # noqa: BLE001 - the parent reports it; the child must never return
            answer = {"refused": f"{type(exc).__name__}: {exc}"}
            code = 1
        with os.fdopen(write_end, "w") as pipe:
            json.dump(answer, pipe)
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    answer = json.loads(text) if text else {"refused": "the child that writes as the account died"}
    if "refused" in answer:
        raise Refused(answer["refused"])
    return answer["ok"]


def main():
    module = AnsibleModule(
        argument_spec={
            "account": {"type": "str", "required": True},
            "directories": {"type": "list", "elements": "str", "default": []},
            "files": {"type": "list", "elements": "dict", "default": []},
            "secret_files": {"type": "dict", "default": {}, "no_log": True},
            "check": {"type": "list", "elements": "str", "default": []},
            "read": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    try:
        pwd.getpwnam(module.params["account"])
    except KeyError:
        module.fail_json(msg=f"{module.params['account']} has no account on this host")
    try:
        result = as_account(module.params["account"], module.check_mode, module.params)
    except Refused as exc:
        module.fail_json(msg=str(exc))
    except OSError as exc:
        module.fail_json(msg=f"{exc.filename or module.params['account']}: {exc.strerror}")
    module.exit_json(changed=bool(result["changed_paths"]), **result)


if __name__ == "__main__":
    main()
