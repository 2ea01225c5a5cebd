#!/usr/bin/python
from __future__ import annotations

DOCUMENTATION = r"""
---
module: box_hand_over
short_description: Leave a sealed box's logins to its buyer alone, then empty the journal
description:
  - The last task of C(controller seal) (roles/box_seal C(tasks/hand-over.yml)), one call because it may remove the
    account Ansible logs in as. In check mode it changes nothing and fails on what would stop it (run first, in
    the role's preflight).
  - Every account's authorized keys files go (the paths sshd's C(AuthorizedKeysFile) names for it, read from
    C(sshd -T), and C(.ssh/authorized_keys) and C(.ssh/authorized_keys2) whatever sshd says); root and the buyer
    account get exactly the buyer's keys instead. A link or a folder where a key file or C(.ssh) should be stops it
    before anything changes.
  - Every password that opens an account is locked (C(usermod -L)), root's too when the buyer has a key; without
    one, root's password is the buyer's way in at the console and stays (reported).
  - The builder account's sudo rules are taken out of C(/etc/sudoers) and C(/etc/sudoers.d) (each edited file is
    checked with C(visudo -cf) before it replaces the old one; a file left without rules goes); then the account
    goes with its home, mail, crontab and lingering. The buyer account loses its rules and its C(sudo), C(wheel)
    and C(admin) groups, or with C(buyer_sudo) gets one rule of its own, C(/etc/sudoers.d/v100box-buyer).
  - Last, the journal is rotated and every journal folder under C(/var/log/journal) and C(/run/log/journal) is
    vacuumed by name (the machine id may already say C(uninitialized), so C(journalctl) could not find its own);
    nothing logged before this call stays readable.
  - Linux only. What it could not do once it started changing the box is returned in C(left), never as a failure,
    because the builder's key may already be gone and the controller must still record the seal.
options:
  buyer_keys:
    description: The buyer's SSH public key lines; empty, no key opens the box.
    type: list
    elements: str
    default: []
  buyer_account:
    description: An account left to the buyer (besides root) with only the buyer's keys; it must exist. Empty, none.
    type: str
    default: ""
  buyer_sudo:
    description: Whether the buyer account may run anything as root through sudo (without a password, as it has none).
    type: bool
    default: false
  builder_account:
    description: The account the builder connected as, removed with its sudo rules; empty when that is root or the
      buyer account.
    type: str
    default: ""
  journal:
    description: Whether to rotate the journal and vacuum every journal folder at the end.
    type: bool
    default: true
author: v100box maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Leave the box's logins to the buyer alone
  v100box.llm.box_hand_over:
    buyer_keys: ["ssh-ed25519 AAAA... buyer@laptop"]
    buyer_account: owner
    buyer_sudo: true
    builder_account: builder
"""

RETURN = r"""
keys_written:
  description: The authorized keys files that now hold exactly the buyer's keys.
  type: list
  elements: str
  returned: always
keys_removed:
  description: The authorized keys files removed (every other account's, and root's and the buyer's other files).
  type: list
  elements: str
  returned: always
passwords_locked:
  description: The accounts whose password was locked.
  type: list
  elements: str
  returned: always
root_password_kept:
  description: True when root has a password and no buyer key was given, so it stays.
  type: bool
  returned: always
sudo_edited:
  description: The sudoers files the builder's (or the buyer account's) rules were taken out of.
  type: list
  elements: str
  returned: always
sudo_removed:
  description: The sudoers files removed because no rule was left in them.
  type: list
  elements: str
  returned: always
sudo_buyer:
  description: The buyer account's own sudoers file, when buyer_sudo asked for it.
  type: str
  returned: always
groups_left:
  description: The admin groups (sudo, wheel, admin) the buyer account was taken out of.
  type: list
  elements: str
  returned: always
account_removed:
  description: The builder account removed (empty when none was).
  type: str
  returned: always
journal_vacuumed:
  description: The journal folders vacuumed.
  type: list
  elements: str
  returned: always
left:
  description: What could not be done, one sentence each (empty when everything was).
  type: list
  elements: str
  returned: always
"""

import grp
import os
import pwd
import re
import stat
import tempfile
import time

from ansible.module_utils.basic import AnsibleModule

DEFAULT_KEY_FILES = [".ssh/authorized_keys", ".ssh/authorized_keys2"]
SUDOERS = "/etc/sudoers"
SUDOERS_DIR = "/etc/sudoers.d"
BUYER_SUDOERS = SUDOERS_DIR + "/v100box-buyer"
ADMIN_GROUPS = ("sudo", "wheel", "admin")
JOURNAL_ROOTS = ("/var/log/journal", "/run/log/journal")
# sshd options through which a login can be granted without an authorized keys file: the seal cannot revoke those.
OTHER_WAYS_IN = ("authorizedkeyscommand", "authorizedprincipalscommand", "trustedusercakeys")
# The first words of sudoers lines that are not a user's rule.
_NOT_A_RULE = ("Runas_Alias", "Host_Alias", "Cmnd_Alias", "Cmd_Alias", "#include", "@include", "#includedir",
               "@includedir")
_USER_LIST = re.compile(r"^(\s*)((?:[^\s,=]+\s*,\s*)*[^\s,=]+)(\s+.*)$", re.S)
_DEFAULTS_USERS = re.compile(r"^(\s*Defaults:)((?:[^\s,]+\s*,\s*)*[^\s,]+)(\s.*)?$", re.S)
_USER_ALIAS = re.compile(r"^(\s*User_Alias\s+)(.*)$", re.S)


class Refused(Exception):
    """Something that stops the hand-over before it changes anything."""


# ---------------------------------------------------------------- sshd


def parse_sshd_t(text):
    """``sshd -T``'s lowercase ``key value...`` lines as a dict of their values (a repeated key keeps the first)."""
    options = {}
    for line in text.splitlines():
        parts = line.split(None, 1)
        if parts:
            options.setdefault(parts[0].lower(), parts[1].strip() if len(parts) > 1 else "")
    return options


def other_ways_in(options):
    """sshd options that grant logins the seal cannot see, as ``name value``."""
    return [f"{name} {options[name]}" for name in OTHER_WAYS_IN
            if options.get(name, "none").lower() not in ("", "none")]


def key_file_patterns(options):
    """The AuthorizedKeysFile patterns sshd uses, then the default ones it would use (each once)."""
    named = options.get("authorizedkeysfile", "").split()
    named = [pattern for pattern in named if pattern.lower() != "none"]
    return list(dict.fromkeys(named + DEFAULT_KEY_FILES))


def expand(pattern, account):
    """One AuthorizedKeysFile pattern for one account (``%h``, ``%u``, ``%U``, ``%%``; relative to its home)."""
    tokens = {"%": "%", "h": account.pw_dir, "u": account.pw_name, "U": str(account.pw_uid)}
    path = re.sub(r"%(.)", lambda found: tokens.get(found.group(1), found.group(0)), pattern)
    return os.path.normpath(path if path.startswith("/") else os.path.join(account.pw_dir, path))


# ---------------------------------------------------------------- passwords


def password_opens(field):
    """Whether a shadow password field lets someone log in with a password (empty: without one)."""
    return not field.startswith(("!", "*"))


def read_shadow(path="/etc/shadow"):
    """Account -> its password field."""
    fields = {}
    with open(path) as shadow:
        for line in shadow:
            parts = line.rstrip("\n").split(":")
            if len(parts) >= 2 and parts[0] and not parts[0].startswith(("+", "-")):
                fields[parts[0]] = parts[1]
    return fields


# ---------------------------------------------------------------- sudoers


def _logical_lines(text):
    """Physical lines joined where one ends in a backslash, each with the text it came from."""
    lines, current = [], ""
    for physical in text.splitlines(keepends=True):
        current += physical
        if not physical.rstrip("\n").endswith("\\"):
            lines.append(current)
            current = ""
    if current:
        lines.append(current)
    return lines


def _drop(entries, names):
    # A negation (!name) stays: without it a list such as "ALL, !name" would grant the account what it denied.
    kept = [entry for entry in entries if entry.strip() not in names]
    return kept, len(kept) != len(entries)


def _strip_user_list(pattern, line, names):
    """``line`` with ``names`` taken out of the user list ``pattern`` finds in it (a rule's users, or those of a
    ``Defaults:`` line): (the line, or None when no user is left; whether a name was taken out). A line that does not
    match, or names none of them, stays byte for byte."""
    found = pattern.match(line.rstrip("\n"))
    if not found:
        return line, False
    kept, dropped = _drop(re.split(r"\s*,\s*", found.group(2)), names)
    if not dropped:
        return line, False
    if not kept:
        return None, True
    return found.group(1) + ", ".join(kept) + (found.group(3) or "") + line[len(line.rstrip("\n")):], True


def strip_sudoers(text, names):
    """``text`` without the rules of ``names`` (an account's name and ``#uid``); returns (text, changed).

    A rule naming only them goes; one naming others too keeps the others; so do ``Defaults:`` lists and User_Alias
    members. Raises Refused when an alias would be left with no member (sudo would reject the file).
    """
    out, changed = [], False
    for line in _logical_lines(text):
        body = line.strip()
        if not body or body.startswith(_NOT_A_RULE) or (body.startswith("#") and not re.match(r"#\d", body)):
            out.append(line)
            continue
        alias = None if body.startswith("Defaults") else _USER_ALIAS.match(line.rstrip("\n"))
        if alias:
            ending = line[len(line.rstrip("\n")):]
            definitions, alias_dropped = [], False
            for definition in re.split(r"\s*:\s*", alias.group(2)):
                name, _equals, members = definition.partition("=")
                kept, dropped = _drop(re.split(r"\s*,\s*", members.strip()), names)
                if dropped and not kept:
                    raise Refused(f"User_Alias {name.strip()} names only {', '.join(sorted(names))}; remove it and "
                                  "the rules that use it by hand")
                alias_dropped |= dropped
                definitions.append(f"{name.strip()} = {', '.join(kept)}")
            changed |= alias_dropped
            # Only a line that named the builder is rewritten; every other line stays byte for byte.
            out.append(alias.group(1) + " : ".join(definitions) + ending if alias_dropped else line)
            continue
        kept_line, dropped = _strip_user_list(_DEFAULTS_USERS if body.startswith("Defaults") else _USER_LIST, line,
                                              names)
        changed |= dropped
        if kept_line is not None:
            out.append(kept_line)
    return "".join(out), changed


def has_rules(text):
    """Whether sudoers text holds anything but comments and blank lines."""
    return any(line.strip() and not (line.strip().startswith("#") and not re.match(r"#(\d|include)", line.strip()))
               for line in text.splitlines())


def sudoers_files():
    files = [SUDOERS] if os.path.isfile(SUDOERS) else []
    if os.path.isdir(SUDOERS_DIR):
        files += [os.path.join(SUDOERS_DIR, name) for name in sorted(os.listdir(SUDOERS_DIR))
                  if os.path.isfile(os.path.join(SUDOERS_DIR, name))
                  and not os.path.islink(os.path.join(SUDOERS_DIR, name))]
    return files


# ---------------------------------------------------------------- the plan, then the changes


class HandOver:
    def __init__(self, module):
        self.module = module
        self.params = module.params
        self.keys_written, self.keys_removed, self.locked = [], [], []
        self.sudo_edited, self.sudo_removed, self.groups_left, self.left = [], [], [], []
        self.sudo_buyer, self.account_removed, self.journal = "", "", []
        self.root_password_kept = False

    def run(self, argv):
        return self.module.run_command(argv)

    def account(self, name):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            return None

    # ---------------------------------------------------------------- plan (nothing changes)

    def plan(self):
        params = self.params
        for name in (params["buyer_account"], params["builder_account"]):
            if name == "root":
                raise Refused("root cannot be the buyer or builder account: it is always left to the buyer")
        if params["buyer_account"] and params["buyer_account"] == params["builder_account"]:
            raise Refused(f"{params['buyer_account']} cannot be both the buyer account and the builder account")
        if params["buyer_account"] and not self.module.check_mode and self.account(params["buyer_account"]) is None:
            raise Refused(f"the buyer account {params['buyer_account']} does not exist")
        rc, out, err = self.run(["/usr/sbin/sshd", "-T"])
        if rc != 0:
            raise Refused(f"sshd -T failed, so the key files sshd reads are unknown: {(err or out).strip()[:300]}")
        options = parse_sshd_t(out)
        others = other_ways_in(options)
        if others:
            options_named = ", ".join(other.split()[0] for other in others)
            raise Refused(f"sshd also lets in whoever {' and '.join(others)} names, which the seal cannot revoke: "
                          f"remove {options_named} from sshd's configuration and seal again")
        patterns = key_file_patterns(options)
        keep = ["root"] + ([params["buyer_account"]] if params["buyer_account"] else [])
        self.key_files = {}  # path -> (account, write the buyer's keys?)
        for account in pwd.getpwall():
            for index, pattern in enumerate(patterns):
                path = expand(pattern, account)
                write = bool(params["buyer_keys"]) and account.pw_name in keep and index == 0
                if write or os.path.lexists(path):
                    previous = self.key_files.get(path)
                    self.key_files[path] = (account, write or bool(previous and previous[1]))
        for path, (account, write) in sorted(self.key_files.items()):
            if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode) and not os.path.islink(path):
                raise Refused(f"{path} (a key file of {account.pw_name}) is not a file; remove it and seal again")
            folder = os.path.dirname(path)
            if write and os.path.islink(folder):
                raise Refused(f"{folder} of {account.pw_name} is a link; remove it and seal again")
        self.sudo_plan = []  # (path, new text or None to remove)
        accounts = [name for name in (params["builder_account"], params["buyer_account"]) if name]
        names = set()
        for name in accounts:
            found = self.account(name)
            names |= {name} | ({f"#{found.pw_uid}"} if found else set())
        if names:
            for path in sudoers_files():
                if path == BUYER_SUDOERS:
                    self.sudo_plan.append((path, None))
                    continue
                with open(path) as handle:
                    text = handle.read()
                try:
                    new, changed = strip_sudoers(text, names)
                except Refused as exc:
                    raise Refused(f"{path}: {exc}") from None
                if not changed:
                    continue
                if path != SUDOERS and not has_rules(new):
                    self.sudo_plan.append((path, None))
                    continue
                self.check_sudoers(new, path)
                self.sudo_plan.append((path, new))
        if params["buyer_sudo"]:
            self.check_sudoers(self.buyer_rule(), BUYER_SUDOERS)

    def buyer_rule(self):
        return ("# Written by controller seal: the buyer account runs anything as root (it has no password).\n"
                f"{self.params['buyer_account']} ALL=(ALL:ALL) NOPASSWD: ALL\n")

    def check_sudoers(self, text, path):
        with tempfile.NamedTemporaryFile("w", prefix=".v100box-sudoers-", dir="/tmp", delete=False) as handle:
            handle.write(text)
        os.chmod(handle.name, 0o440)  # what visudo expects of a sudoers file
        try:
            rc, out, err = self.run(["visudo", "-c", "-q", "-f", handle.name])
        finally:
            os.unlink(handle.name)
        if rc != 0:
            whose = ", ".join(filter(None, (self.params["builder_account"], self.params["buyer_account"])))
            raise Refused(f"{path} would not be valid sudoers without the rules of {whose} (visudo: "
                          f"{(err or out).strip()[:200]}); edit it by hand and seal again")

    # ---------------------------------------------------------------- act

    def act(self):
        self.hand_over_sudo()
        self.lock_passwords()
        self.hand_over_keys()
        self.remove_builder()
        if self.params["journal"]:
            self.empty_journal()

    def _attempt(self, what, action, *args):
        try:
            action(*args)
            return True
        except (OSError, RuntimeError) as exc:
            self.left.append(f"{what}: {exc}")
            return False

    def _write(self, path, text, uid, gid, mode):
        folder = os.path.dirname(path)
        handle = tempfile.NamedTemporaryFile("w", prefix=".v100box-", dir=folder, delete=False)
        try:
            with handle:
                handle.write(text)
            os.chown(handle.name, uid, gid)
            os.chmod(handle.name, mode)
            os.replace(handle.name, path)  # replaces a link itself, never what it points at
        except BaseException:
            if os.path.lexists(handle.name):
                os.unlink(handle.name)
            raise

    def _folder(self, path, owner):
        os.makedirs(path, 0o700)
        os.chown(path, *owner)

    def hand_over_sudo(self):
        for path, text in self.sudo_plan:
            if text is None:
                if self._attempt("remove " + path, os.unlink, path):
                    self.sudo_removed.append(path)
            else:
                found = os.stat(path)
                if self._attempt("edit " + path, self._write, path, text, found.st_uid, found.st_gid,
                                 stat.S_IMODE(found.st_mode)):
                    self.sudo_edited.append(path)
        buyer = self.params["buyer_account"]
        if not buyer:
            return
        if self.params["buyer_sudo"]:
            if self._attempt("write " + BUYER_SUDOERS, self._write, BUYER_SUDOERS, self.buyer_rule(), 0, 0, 0o440):
                self.sudo_buyer = BUYER_SUDOERS
            return
        for group in grp.getgrall():
            if group.gr_name in ADMIN_GROUPS and buyer in group.gr_mem:
                rc, out, err = self.run(["gpasswd", "-d", buyer, group.gr_name])
                if rc == 0:
                    self.groups_left.append(group.gr_name)
                else:
                    self.left.append(f"take {buyer} out of group {group.gr_name}: {(err or out).strip()}")

    def lock_passwords(self):
        try:
            fields = read_shadow()
        except OSError as exc:
            self.left.append(f"read /etc/shadow to lock passwords: {exc}")
            return
        for name, field in sorted(fields.items()):  # the builder's too: its removal could fail
            if not password_opens(field):
                continue
            if name == "root" and not self.params["buyer_keys"]:
                self.root_password_kept = True
                continue
            rc, out, err = self.run(["usermod", "--lock", name])
            if rc == 0:
                self.locked.append(name)
            else:
                self.left.append(f"lock the password of {name}: {(err or out).strip()}")

    def hand_over_keys(self):
        text = "".join(key.strip() + "\n" for key in self.params["buyer_keys"])
        for path, (account, write) in sorted(self.key_files.items()):
            if not write:
                if self._attempt("remove " + path, os.unlink, path):
                    self.keys_removed.append(path)
                continue
            folder = os.path.dirname(path)
            in_home = path.startswith(account.pw_dir.rstrip("/") + "/")
            owner = (account.pw_uid, account.pw_gid) if in_home else (0, 0)
            if not os.path.isdir(folder) and not self._attempt("create " + folder, self._folder, folder, owner):
                continue
            if self._attempt("write " + path, self._write, path, text, *owner, 0o600 if in_home else 0o644):
                self.keys_written.append(path)

    def remove_builder(self):
        name = self.params["builder_account"]
        if not name or self.account(name) is None:
            return
        for path in ("/var/spool/cron/crontabs/" + name, "/var/spool/cron/" + name, "/var/lib/systemd/linger/" + name):
            if os.path.lexists(path) and not os.path.isdir(path):
                self._attempt("remove " + path, os.unlink, path)
        # --force: the account is logged in (this very connection); its processes end when Ansible disconnects.
        rc, out, err = self.run(["userdel", "--force", "--remove", name])
        if self.account(name) is None:
            self.account_removed = name
            if rc != 0:
                self.left.append(f"finish removing {name} (userdel: {(err or out).strip()})")
        else:
            self.left.append(f"remove the account {name}: userdel says {(err or out).strip()}")

    def empty_journal(self):
        rc, out, err = self.run(["journalctl", "--rotate"])
        if rc != 0:
            self.left.append(f"rotate the journal (its active files keep what they hold): {(err or out).strip()}")
        folders = [os.path.join(root, name) for root in JOURNAL_ROOTS if os.path.isdir(root)
                   for name in sorted(os.listdir(root)) if os.path.isdir(os.path.join(root, name))]
        for folder in folders:
            for attempt in range(2):  # --vacuum-time=1s spares a file whose first entry is younger than a second
                if attempt:
                    time.sleep(1.5)
                rc, out, err = self.run(["journalctl", "--directory", folder, "--vacuum-time=1s", "--quiet"])
                archived = [name for name in os.listdir(folder) if "@" in name]
                if rc != 0 or not archived:
                    break
            if rc != 0 or archived:
                why = (err or out).strip() if rc != 0 else f"{len(archived)} archived files remain"
                self.left.append(f"vacuum the journal in {folder}: {why}")
            else:
                self.journal.append(folder)

    def result(self):
        return {"keys_written": self.keys_written, "keys_removed": self.keys_removed, "passwords_locked": self.locked,
                "root_password_kept": self.root_password_kept, "sudo_edited": self.sudo_edited,
                "sudo_removed": self.sudo_removed, "sudo_buyer": self.sudo_buyer, "groups_left": self.groups_left,
                "account_removed": self.account_removed, "journal_vacuumed": self.journal, "left": self.left}


ARGUMENT_SPEC = {
    "buyer_keys": {"type": "list", "elements": "str", "default": [], "no_log": False},  # public keys
    "buyer_account": {"type": "str", "default": ""},
    "buyer_sudo": {"type": "bool", "default": False},
    "builder_account": {"type": "str", "default": ""},
    "journal": {"type": "bool", "default": True},
}


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    if module.params["buyer_sudo"] and not module.params["buyer_account"]:
        module.fail_json(msg="buyer_sudo needs buyer_account")
    hand_over = HandOver(module)
    try:
        hand_over.plan()
    except Refused as exc:
        module.fail_json(msg=str(exc))
    if module.check_mode:
        module.exit_json(changed=bool(hand_over.key_files or hand_over.sudo_plan), **hand_over.result())
    hand_over.act()
    result = hand_over.result()
    changed = any(result[key] for key in ("keys_written", "keys_removed", "passwords_locked", "sudo_edited",
                                          "sudo_removed", "sudo_buyer", "groups_left", "account_removed",
                                          "journal_vacuumed"))
    module.exit_json(changed=changed, **result)


if __name__ == "__main__":
    main()
