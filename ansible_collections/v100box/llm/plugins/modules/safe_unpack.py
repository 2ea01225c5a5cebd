#!/usr/bin/python
"""Ansible module: unpack an engine pack or source tarball as root without trusting what the archive says."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: safe_unpack
short_description: Unpack a tar or zip archive without its owners, special modes or escaping links
description:
  - Unpacks O(src) (tar, tar.gz, tar.bz2, tar.xz or zip, recognised by content) into O(dest), which must not
    exist yet or be an empty folder. Meant for archives root unpacks, such as engine packs, where a crafted
    archive must not be able to plant a setuid binary or write outside O(dest).
  - Nothing is taken from the archive but names, contents, the executable bit and link targets. Every file
    belongs to the user running the module; folders get C(0755), executables C(0755), other files C(0644).
  - Refused, with the member named, and O(dest) removed again, are absolute names and names with C(..), setuid or
    setgid members, device files, FIFOs and sockets, symbolic links whose target leaves O(dest) or is
    absolute, hard links to anything but a file unpacked before them, a member reached through a link, and two
    members with the same name.
  - Does the checks itself rather than relying on Python's tar extraction filters, which the Python 3.11.2 of
    Debian 12 does not have.
options:
  src:
    description: Path of the archive on the managed host.
    type: path
    required: true
  dest:
    description: Folder to unpack into; created with mode C(0755). It must not exist or be empty.
    type: path
    required: true
  strip_components:
    description: Leading path components to drop from every member name, as C(tar --strip-components).
    type: int
    default: 0
attributes:
  check_mode:
    support: full
    description: Reads and checks the archive when it exists; writes nothing.
author:
  - v100box maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Unpack the engine pack
  v100box.llm.safe_unpack:
    src: /opt/llama/.downloads/llama-upstream-02182fc-linux-x86_64.tar.gz
    dest: /opt/llama/upstream/02182fc.partial
"""

RETURN = r"""
dest:
  description: The folder unpacked into.
  returned: always
  type: str
files:
  description: Regular files unpacked (or that would be, in check mode).
  returned: always
  type: int
links:
  description: Symbolic and hard links created.
  returned: always
  type: int
"""

import errno
import os
import posixpath
import shutil
import stat
import tarfile
import zipfile
from collections.abc import Iterator
from typing import IO, Any, NamedTuple

from ansible.module_utils.basic import AnsibleModule

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
COPY_CHUNK = 1 << 20


class UnpackError(Exception):
    """The archive or the destination is refused; the message names the member and the reason."""


class Member(NamedTuple):
    """One archive entry, reduced to what is trusted: a name, a kind, the executable bit, a link target."""

    name: str  # relative, normalised, components stripped
    kind: str  # "file", "dir", "symlink", "hardlink"
    executable: bool
    link: str  # symlink target as written, or the hard link's member name (normalised, stripped)
    open: Any  # () -> binary stream of the contents, for files


def _clean(raw: str, strip: int, what: str) -> str | None:
    """The member's name inside dest, or None when stripping leaves nothing; refuses escaping names."""
    if "\0" in raw or "\\" in raw:
        raise UnpackError(f"{what}: the name {raw!r} holds a NUL or backslash")
    if raw.startswith("/"):
        raise UnpackError(f"{what}: the absolute name {raw!r} would write outside the folder")
    parts = [part for part in raw.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise UnpackError(f"{what}: the name {raw!r} climbs out of the folder with '..'")
    parts = parts[strip:]
    return "/".join(parts) if parts else None


def _check_mode_bits(mode: int, name: str) -> None:
    if mode & (stat.S_ISUID | stat.S_ISGID):
        raise UnpackError(f"{name} is setuid or setgid (mode {stat.S_IMODE(mode):04o}); a pack never needs that")


def _check_symlink(name: str, target: str) -> None:
    if not target or target.startswith("/") or "\0" in target:
        raise UnpackError(f"{name} is a link to {target!r}: only relative links inside the folder are allowed")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
    if resolved == ".." or resolved.startswith("../"):
        raise UnpackError(f"{name} is a link to {target!r}, which leaves the folder")


def _tar_members(archive: tarfile.TarFile, strip: int) -> Iterator[Member]:
    for info in archive:
        what = f"member {info.name!r}"
        name = _clean(info.name, strip, what)
        if not info.isdir():  # a setgid folder only passes its group on; the mode is not kept anyway
            _check_mode_bits(info.mode, info.name)
        if info.isdev() or info.isfifo() or not (info.isreg() or info.isdir() or info.issym() or info.islnk()):
            raise UnpackError(f"{what} is a device, FIFO or other special file; a pack holds files, folders, links")
        if name is None:
            continue
        if info.issym():
            _check_symlink(name, info.linkname)
            yield Member(name, "symlink", False, info.linkname, None)
        elif info.islnk():
            target = _clean(info.linkname, strip, f"{what} (hard link to {info.linkname!r})")
            yield Member(name, "hardlink", False, target or "", None)
        elif info.isdir():
            yield Member(name, "dir", False, "", None)
        else:
            yield Member(name, "file", bool(info.mode & 0o111), "", lambda info=info: archive.extractfile(info))


def _zip_members(archive: zipfile.ZipFile, strip: int) -> Iterator[Member]:
    for info in archive.infolist():
        what = f"member {info.filename!r}"
        name = _clean(info.filename, strip, what)
        mode = info.external_attr >> 16 if info.create_system == 3 else 0  # unix attributes, when recorded
        kind = stat.S_IFMT(mode)
        if kind != stat.S_IFDIR:
            _check_mode_bits(mode, info.filename)
        if kind not in (0, stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK):
            raise UnpackError(f"{what} is a device, FIFO or other special file; a pack holds files, folders, links")
        if name is None:
            continue
        if kind == stat.S_IFLNK:
            target = archive.read(info).decode("utf-8", "surrogateescape")
            _check_symlink(name, target)
            yield Member(name, "symlink", False, target, None)
        elif info.is_dir() or kind == stat.S_IFDIR:
            yield Member(name, "dir", False, "", None)
        else:
            yield Member(name, "file", bool(mode & 0o111), "", lambda info=info: archive.open(info))


def members(src: str, strip: int) -> Iterator[Member]:
    """The archive's entries, checked; the archive stays open while they are consumed."""
    if zipfile.is_zipfile(src):
        with zipfile.ZipFile(src) as archive:
            yield from _zip_members(archive, strip)
        return
    try:
        archive = tarfile.open(src, "r:*")
    except (tarfile.TarError, OSError) as error:
        raise UnpackError(f"{src} is not a tar or zip archive this module reads: {error}") from None
    with archive:
        try:
            yield from _tar_members(archive, strip)
        except tarfile.TarError as error:
            raise UnpackError(f"{src} is damaged: {error}") from None


class Tree:
    """The destination folder; every path below it is walked component by component, never through a link."""

    def __init__(self, dest: str) -> None:
        self.dest = dest
        try:
            os.mkdir(dest, 0o755)
        except FileExistsError:
            pass
        self.fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
        found = os.fstat(self.fd)
        if found.st_uid != os.geteuid() or os.listdir(self.fd):
            os.close(self.fd)
            raise UnpackError(f"{dest} must be a new or empty folder of the user running the unpack; remove it first")
        os.fchmod(self.fd, 0o755)
        self.files: set[str] = set()

    def close(self) -> None:
        os.close(self.fd)

    def parent(self, name: str) -> tuple[int, str]:
        """An fd of the folder holding ``name`` (created as needed, 0755) and the last component."""
        *folders, leaf = name.split("/")
        fd = os.dup(self.fd)
        try:
            for index, part in enumerate(folders):
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                try:
                    child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=fd)
                except OSError as error:
                    if error.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise UnpackError(
                            f"{name} would be written through {'/'.join(folders[: index + 1])}, which is a link or "
                            f"a file") from None
                    raise
                os.fchmod(child, 0o755)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd, leaf

    def add(self, member: Member) -> None:
        fd, leaf = self.parent(member.name)
        try:
            if member.kind == "dir":
                try:
                    os.mkdir(leaf, 0o755, dir_fd=fd)
                except FileExistsError:
                    child = os.open(leaf, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=fd)  # a folder, not a link
                    os.close(child)
            elif member.kind == "symlink":
                os.symlink(member.link, leaf, dir_fd=fd)
            elif member.kind == "hardlink":
                if member.link not in self.files:
                    raise UnpackError(f"{member.name} is a hard link to {member.link!r}, which is no file unpacked "
                                      f"before it")
                source_fd, source_leaf = self.parent(member.link)
                try:
                    os.link(source_leaf, leaf, src_dir_fd=source_fd, dst_dir_fd=fd, follow_symlinks=False)
                finally:
                    os.close(source_fd)
                self.files.add(member.name)
            else:
                self._write(fd, leaf, member)
                self.files.add(member.name)
        except FileExistsError:
            raise UnpackError(f"{member.name} appears twice in the archive") from None
        finally:
            os.close(fd)

    @staticmethod
    def _write(folder_fd: int, leaf: str, member: Member) -> None:
        out = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=folder_fd)
        try:
            source: IO[bytes] = member.open()
            with source:
                while chunk := source.read(COPY_CHUNK):
                    os.write(out, chunk)
            os.fchmod(out, 0o755 if member.executable else 0o644)
        finally:
            os.close(out)


def unpack(src: str, dest: str, strip: int = 0, check_mode: bool = False) -> dict[str, Any]:
    if not os.path.isfile(src):
        if check_mode:
            return {"changed": True, "dest": dest, "files": 0, "links": 0, "msg": f"would unpack {src}"}
        raise UnpackError(f"{src} does not exist")
    if os.path.lexists(dest) and (os.path.islink(dest) or not os.path.isdir(dest)):
        raise UnpackError(f"{dest} exists and is not a folder; remove it first")
    counts = {"file": 0, "dir": 0, "symlink": 0, "hardlink": 0}
    if check_mode:
        for member in members(src, strip):
            counts[member.kind] += 1
    else:
        tree = Tree(dest)
        try:
            for member in members(src, strip):
                tree.add(member)
                counts[member.kind] += 1
        except BaseException:
            tree.close()
            shutil.rmtree(dest, ignore_errors=True)
            raise
        tree.close()
    return {"changed": True, "dest": dest, "files": counts["file"], "links": counts["symlink"] + counts["hardlink"],
            "msg": f"{'would unpack' if check_mode else 'unpacked'} {counts['file']} files from {src}"}


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "src": {"type": "path", "required": True},
            "dest": {"type": "path", "required": True},
            "strip_components": {"type": "int", "default": 0},
        },
        supports_check_mode=True,
    )
    params = module.params
    try:
        result = unpack(params["src"], params["dest"], params["strip_components"], module.check_mode)
    except UnpackError as error:
        module.fail_json(msg=f"Refusing to unpack {params['src']}: {error}.", dest=params["dest"])
    except OSError as error:
        module.fail_json(msg=f"Cannot unpack {params['src']} into {params['dest']}: {error}.", dest=params["dest"])
    module.exit_json(**result)


if __name__ == "__main__":
    main()
