#!/usr/bin/python
"""Ansible module: download a multi-gigabyte model file resumably and verify its SHA-256 in one pass."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gguf_download
short_description: Download a large model file resumably and verify its SHA-256
description:
  - Downloads O(url) to O(dest) through C(<dest>.part) in the same folder. An interrupted transfer
    keeps the partial file and the next run resumes it with a C(Range) request.
  - The SHA-256 is computed while the bytes arrive (after re-reading the partial file from local disk
    when resuming), so a model is read once. O(dest) is replaced only after the hash matches, by an atomic
    rename; an older good file stays in place until then.
  - After a verified download a marker C(<dest>.verified) records hash, size, mtime, inode and owner, so
    later runs skip without rereading tens of gigabytes. A file without a valid marker is hashed once.
  - Two runs for the same O(dest) on one box take turns through C(flock) on C(<dest>.lock); the second
    waits, then finds the file verified. No file is marked verified while another writer appends to it.
  - The folder is opened once without following a link planted in its place, and every file in it is
    opened relative to that folder with C(O_NOFOLLOW) (new files also C(O_EXCL)). A partial file, marker
    or lock that is a link, not a regular file, hard-linked or owned by another user is removed, never
    written through. A folder that others can write to is refused; a folder that is a link is accepted
    only when the link belongs to root or to the user running the module.
  - Before any byte is fetched, the free space of the folder must cover the missing bytes plus a
    64 MiB margin; the expected size comes from O(size) or the C(HEAD) C(Content-Length).
  - Redirects are followed. The token is sent only over HTTPS and only to a host listed in O(token_hosts),
    never over plain HTTP and never to the host a redirect points at (model hubs redirect to a CDN with a
    signed URL that needs no token).
options:
  url:
    description: HTTP(S) URL of the file.
    type: str
    required: true
  dest:
    description: Full path of the final file. Its folder must exist and be writable only by its owner.
    type: path
    required: true
  sha256:
    description: Expected SHA-256 of the file, 64 hex digits.
    type: str
    required: true
  size:
    description: Expected size in bytes; without it a C(HEAD) request asks the server.
    type: int
  token:
    description: Bearer token sent as C(Authorization) over HTTPS to a host in O(token_hosts). Never logged.
    type: str
  token_hosts:
    description: Host names the token may be sent to (HTTPS only). Anything else gets no token.
    type: list
    elements: str
    default: [huggingface.co]
  headers:
    description: Extra request headers. Put secrets in O(token), not here.
    type: dict
    default: {}
  timeout:
    description: Seconds to wait for a connection or for the next bytes before the transfer counts as interrupted.
    type: int
    default: 60
  owner:
    description: Owner of O(dest); the user running the module when unset.
    type: str
  group:
    description: Group of O(dest); left as created when unset.
    type: str
  mode:
    description: Permissions of O(dest) as an octal string such as C("0640"); C(0644) for a new file when unset.
    type: raw
attributes:
  check_mode:
    support: full
    description: Reports whether a download would happen; fetches nothing, writes nothing.
author:
  - v100box maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Download the Gemma model
  v100box.llm.gguf_download:
    url: "https://huggingface.co/google/gemma/resolve/main/gemma.gguf"
    dest: /var/lib/llama/models/gemma.gguf
    sha256: "{{ gemma_sha256 }}"
    size: "{{ gemma_size_bytes }}"
    token: "{{ hf_token | default(omit, true) }}"
    owner: root
    group: llama
    mode: "0640"
"""

RETURN = r"""
dest:
  description: Path of the final file.
  returned: always
  type: str
sha256:
  description: SHA-256 of the file at O(dest).
  returned: always
  type: str
size:
  description: Size of the file in bytes (expected size in check mode when a download is due).
  returned: always
  type: int
bytes_transferred:
  description: Body bytes received from the server by this run.
  returned: always
  type: int
resumed_from:
  description: Bytes of an earlier partial download that this run kept (0 when it started fresh).
  returned: always
  type: int
waited:
  description: Seconds this run waited for another download of the same file to finish.
  returned: always
  type: float
elapsed:
  description: Seconds this run took.
  returned: always
  type: float
"""

import errno
import fcntl
import grp
import hashlib
import json
import os
import pwd
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from http.client import HTTPException, HTTPResponse
from typing import Any, NamedTuple

from ansible.module_utils.basic import AnsibleModule

CHUNK = 4 << 20
SPACE_MARGIN = 64 << 20
GIB = 1 << 30
DEFAULT_TOKEN_HOSTS = ("huggingface.co",)
NEW_FILE_MODE = 0o644
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class DownloadError(Exception):
    """A failure the operator can act on; the message says what to do."""


class RangeNotSatisfiable(DownloadError):
    """HTTP 416: the partial file is not shorter than the server's file, so it cannot be a prefix."""


class Transfer(NamedTuple):
    """What one download did: the hash of the whole part file and how many bytes came over the wire."""

    sha256: str
    size: int
    transferred: int
    resumed_from: int


class Attributes(NamedTuple):
    """Owner, group and mode wanted for the final file; None leaves that one as it is."""

    uid: int | None
    gid: int | None
    mode: int | None


def part_path(dest: str) -> str:
    return dest + ".part"


def marker_path(dest: str) -> str:
    return dest + ".verified"


def lock_path(dest: str) -> str:
    return dest + ".lock"


# -- the folder: every file is reached relative to one descriptor, never through a link -----------


class Folder:
    """The download folder, opened once; names inside it are opened with O_NOFOLLOW relative to it.

    A writer that can rename entries in the folder could otherwise swap a file for a link between a
    check and a write, and root would write through it.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = open_folder(path)

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        return os.open(name, flags | _NOFOLLOW, mode, dir_fd=self.fd)

    def open_own(self, name: str) -> int | None:
        """Open an existing regular file this user owns alone for reading, else None (nothing is followed)."""
        try:
            fd = self.open(name, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as error:
            if error.errno in (errno.ENOENT, errno.ELOOP):
                return None
            raise
        if not _own_regular(os.fstat(fd)):
            os.close(fd)
            return None
        return fd

    def replace(self, source: str, target: str) -> None:
        os.replace(source, target, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def sync(self) -> None:
        os.fsync(self.fd)

    def remove_foreign(self, name: str) -> None:
        """Delete ``name`` when it is anything but a regular file of ours with one link (a planted entry)."""
        found = self.lstat(name)
        if found is not None and not _own_regular(found):
            self.unlink(name)


def _own_regular(found: os.stat_result) -> bool:
    return stat.S_ISREG(found.st_mode) and found.st_nlink == 1 and found.st_uid == os.geteuid()


def open_folder(path: str) -> int:
    """Open the download folder; refuse one that others can write to or a link someone else planted."""
    euid = os.geteuid()
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        raise DownloadError(f"The folder {path} does not exist: create it before downloading into it.") from None
    target = path
    if stat.S_ISLNK(found.st_mode):
        if found.st_uid not in (0, euid):
            raise DownloadError(
                f"The folder {path} is a link owned by {_user(found.st_uid)}, not by root: another account could "
                f"point it anywhere. Remove the link and let the role create the folder, or recreate the link as root."
            )
        target = os.path.realpath(path)
    try:
        fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except OSError as error:
        raise DownloadError(f"Cannot open the folder {path}: {error.strerror}.") from None
    opened = os.fstat(fd)
    if opened.st_uid not in (0, euid) or opened.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise DownloadError(
            f"The folder {path} can be changed by others (owner {_user(opened.st_uid)}, mode "
            f"{stat.S_IMODE(opened.st_mode):04o}), who could plant links the download would write through. "
            f"Make it owned by root and not writable by group or others (the gguf_model role does this)."
        )
    return fd


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


# -- one writer per file ---------------------------------------------------------------------------


class FileLock:
    """``flock`` on ``<name>.lock`` beside the file: a second download of the same file waits its turn.

    The holder deletes the lock file before releasing it; a waiter that then gets the lock of a deleted
    file notices (the name no longer points at its inode) and takes the new one.
    """

    def __init__(self, folder: Folder, name: str) -> None:
        self.folder, self.name, self.fd, self.waited = folder, name, -1, 0.0

    def __enter__(self) -> FileLock:
        started = time.monotonic()
        while True:
            self.folder.remove_foreign(self.name)  # a link or someone else's file: never ours to lock
            try:
                fd = self.folder.open(self.name, os.O_RDWR | os.O_CREAT)
            except OSError as error:
                if error.errno == errno.ELOOP:  # a link appeared after the check: remove it, try again
                    continue
                raise DownloadError(f"Cannot create the lock {self.folder.join(self.name)}: {error.strerror}.") from None
            if not _own_regular(os.fstat(fd)):
                os.close(fd)
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)
            current = self.folder.lstat(self.name)
            if current is not None and current.st_ino == os.fstat(fd).st_ino:
                self.fd, self.waited = fd, time.monotonic() - started
                return self
            os.close(fd)  # the previous holder removed this lock file meanwhile

    def __exit__(self, *exc: object) -> None:
        self.folder.unlink(self.name)
        os.close(self.fd)


# -- what is on disk -------------------------------------------------------------------------------


def hash_file(path: str, digest: Any | None = None) -> Any:
    """Feed a local file into ``digest`` (a fresh SHA-256 by default) and return it."""
    digest = digest if digest is not None else hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    try:
        return _hash_fd(fd, digest)
    finally:
        os.close(fd)


def _hash_fd(fd: int, digest: Any, offset: int = 0) -> Any:
    while chunk := os.pread(fd, CHUNK, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest


def _marker_for(found: os.stat_result, sha256: str) -> dict[str, Any]:
    """What a marker records: replacing the file (new inode or owner) or rewriting it (mtime) voids it."""
    return {
        "sha256": sha256,
        "size": found.st_size,
        "mtime_ns": found.st_mtime_ns,
        "inode": found.st_ino,
        "uid": found.st_uid,
    }


def _is_verified(folder: Folder, name: str, sha256: str) -> bool:
    found = folder.lstat(name)
    if found is None or not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
        return False
    fd = folder.open_own(name + ".verified")  # a marker someone else wrote vouches for nothing
    if fd is None:
        return False
    try:
        with os.fdopen(fd, encoding="utf-8") as handle:
            marker = json.load(handle)
    except (OSError, ValueError):
        return False
    return marker == _marker_for(found, sha256)


def is_verified(dest: str, sha256: str) -> bool:
    """True when the marker vouches for ``dest`` as it is now: same hash, size, mtime, inode and owner.

    Trusting these avoids rereading a model on every run; anything that rewrites or replaces the file
    changes one of them and sends it back through a full hash.
    """
    try:
        with Folder(os.path.dirname(dest) or ".") as folder:
            return _is_verified(folder, os.path.basename(dest), sha256)
    except DownloadError:
        return False


def _write_marker(folder: Folder, name: str, sha256: str) -> None:
    found = folder.lstat(name)
    if found is None:  # it was there a moment ago: something else on the box removed it
        raise DownloadError(f"{folder.join(name)} disappeared before its .verified record was written; run again")
    marker, temporary = name + ".verified", name + ".verified.tmp"
    folder.unlink(temporary)
    fd = folder.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, NEW_FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(_marker_for(found, sha256), handle)
        handle.flush()
        os.fsync(handle.fileno())
    folder.replace(temporary, marker)


def write_marker(dest: str, sha256: str) -> None:
    with Folder(os.path.dirname(dest) or ".") as folder:
        _write_marker(folder, os.path.basename(dest), sha256)


def free_bytes(folder: str) -> int:
    """Bytes an unprivileged writer may still use in ``folder`` (the boundary tests replace)."""
    found = os.statvfs(folder)
    return found.f_bavail * found.f_frsize


def check_space(folder: str, size: int, have: int) -> None:
    """Refuse before fetching anything when the missing bytes would not fit."""
    needed = max(size - have, 0) + SPACE_MARGIN
    free = free_bytes(folder)
    if free < needed:
        raise DownloadError(
            f"Not enough free space in {folder}: need {needed / GIB:.2f} GiB ({needed} bytes = "
            f"{size} expected - {have} already downloaded + {SPACE_MARGIN} margin), "
            f"free {free / GIB:.2f} GiB ({free} bytes). Free space there or put the models on a "
            f"larger filesystem."
        )


# -- HTTP ------------------------------------------------------------------------------------------


def _origin(url: str) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, parts.netloc.lower()


def token_allowed(url: str, token_hosts: list[str] | tuple[str, ...]) -> bool:
    """The token goes only over HTTPS, and only to a host it was meant for."""
    parts = urllib.parse.urlsplit(url)
    allowed = {host.lower().rstrip(".") for host in token_hosts}
    return parts.scheme == "https" and (parts.hostname or "").rstrip(".") in allowed


class _ScopedAuthRedirect(urllib.request.HTTPRedirectHandler):
    """Follow redirects, keep the method, and drop Authorization when the scheme or host changes."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is None:
            return None
        new.method = req.get_method()  # the stdlib turns a redirected HEAD into a GET
        if _origin(new.full_url) != _origin(req.full_url) or _origin(new.full_url)[0] != "https":
            new.remove_header("Authorization")
        return new


_OPENER = urllib.request.build_opener(_ScopedAuthRedirect)


def request(url: str, headers: dict[str, str], timeout: float, method: str = "GET") -> HTTPResponse:
    """Open ``url``; turn HTTP and connection errors into messages an operator can act on."""
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        return _OPENER.open(req, timeout=timeout)
    except urllib.error.HTTPError as error:
        if error.code == 416:
            raise RangeNotSatisfiable(f"{_redact(url)} cannot resume at {headers.get('Range')}") from None
        hint = {
            401: "the server wants a token: set token (gguf_model_hf_token in the role); it is sent only over "
                 "https and only to token_hosts (huggingface.co, or the models mirror when the fleet sets "
                 "mirror.models_token)",
            403: "the token has no access: accept the model's licence or use another token",
            404: "no such file: check the url",
        }.get(error.code, "check the url and the server")
        raise DownloadError(
            f"{method} {_redact(url)} failed with HTTP {error.code} {error.reason}: {hint}"
        ) from None
    except (urllib.error.URLError, OSError, HTTPException) as error:
        reason = getattr(error, "reason", error)
        raise DownloadError(f"Cannot reach {_redact(url)}: {reason}") from None


def _redact(url: str) -> str:
    """The URL without its query: signed CDN URLs carry credentials there."""
    return urllib.parse.urlsplit(url)._replace(query="", fragment="").geturl()


def remote_size(url: str, headers: dict[str, str], timeout: float) -> int | None:
    with request(url, headers, timeout, method="HEAD") as response:
        length = response.headers.get("Content-Length")
    return int(length) if length is not None and length.isdigit() else None


def _pump(response: HTTPResponse, out: Any, digest: Any) -> int:
    """Copy the body to ``out`` and into ``digest``; hashing a chunk overlaps reading the next.

    hashlib and file/socket I/O release the GIL, so a second thread keeps SHA-256 off the
    critical path. Two buffers alternate: one is hashed while the other is filled.
    """
    buffers = (memoryview(bytearray(CHUNK)), memoryview(bytearray(CHUNK)))
    pending: Future | None = None
    total = turn = 0
    with ThreadPoolExecutor(max_workers=1) as hasher:
        while count := response.readinto(buffers[turn]):
            chunk = buffers[turn][:count]
            out.write(chunk)
            if pending is not None:
                pending.result()  # the buffer filled next is the one this hash was reading
            pending = hasher.submit(digest.update, chunk)
            total += count
            turn ^= 1
        if pending is not None:
            pending.result()
    return total


# -- the download ----------------------------------------------------------------------------------


def _part_size(folder: Folder, part: str) -> int:
    """Bytes of a partial download to resume; 0 when there is none or it is not ours to trust."""
    found = folder.lstat(part)
    return found.st_size if found is not None and _own_regular(found) else 0


class _Part:
    """The open partial file; created only once the server's answer says what to write."""

    def __init__(self, folder: Folder, name: str) -> None:
        self.folder, self.name, self.fd = folder, name, -1

    def open(self, resume: bool) -> int:
        """Our own earlier partial file to append to, or a new one created without following anything."""
        if self.fd < 0:
            if resume:
                existing = self.folder.open_own(self.name)
                if existing is not None:
                    os.close(existing)
                    self.fd = self.folder.open(self.name, os.O_RDWR)
                    return self.fd
            self.folder.unlink(self.name)  # a planted link or someone else's file is replaced, never written through
            self.fd = self.folder.open(self.name, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _interrupted(folder: Folder, part: str, reason: object) -> DownloadError:
    kept = _part_size(folder, part)
    return DownloadError(
        f"Transfer interrupted ({reason}); {kept} bytes are kept in {folder.join(part)}: a rerun resumes from "
        f"byte {kept}."
    )


def download(url: str, folder: Folder, name: str, headers: dict[str, str], timeout: float,
             size: int | None) -> tuple[Transfer, int]:
    """Fetch ``url`` into ``<name>.part``, resuming what is there; return the hash of the whole part and its fd.

    The partial bytes are hashed from local disk first, then the stream continues the same digest,
    so every byte is read once. The caller closes the returned descriptor.
    """
    part = _Part(folder, part_path(name))
    try:
        transfer = _transfer(url, part, headers, timeout, size)
    except RangeNotSatisfiable:
        part.close()
        folder.unlink(part.name)  # the server's file is shorter than our part: it changed, start over
        return download(url, folder, name, headers, timeout, size)
    except BaseException:
        part.close()
        raise
    return transfer, part.fd


def _transfer(url: str, part: _Part, headers: dict[str, str], timeout: float, size: int | None) -> Transfer:
    folder = part.folder
    have = _part_size(folder, part.name)
    if size is not None and have > size:  # longer than the file: not a prefix of it
        have = 0
    digest = hashlib.sha256()
    if have:
        _hash_fd(part.open(resume=True), digest)
    if have and have == size:  # a previous run got every byte but stopped before verifying
        return Transfer(digest.hexdigest(), have, 0, have)
    response = request(url, dict(headers, Range=f"bytes={have}-") if have else headers, timeout)
    with response:
        if response.status == 206:
            start = _range_start(response.headers.get("Content-Range", ""))
            if start != have:
                raise DownloadError(
                    f"The server resumed at byte {start} instead of {have}: delete {folder.join(part.name)} and "
                    f"rerun."
                )
        else:  # 200: the server ignored the range, so the body is the whole file
            have, digest = 0, hashlib.sha256()
        length = response.headers.get("Content-Length", "")
        expected = have + int(length) if length.isdigit() else size
        if size is not None and expected is not None and expected != size:
            raise DownloadError(
                f"The server's file is {expected} bytes but size says {size}: correct size (or the url)."
            )
        fd = part.open(resume=have > 0)
        os.ftruncate(fd, have)
        out = os.fdopen(fd, "r+b", closefd=False)
        try:
            out.seek(have)
            received = _pump(response, out, digest)
            out.flush()
        except (OSError, HTTPException) as error:
            raise _interrupted(folder, part.name, error) from None
        finally:
            out.close()
    if expected is not None and have + received < expected:
        raise _interrupted(folder, part.name, f"connection closed after {have + received} of {expected} bytes")
    return Transfer(digest.hexdigest(), have + received, received, have)


def _range_start(content_range: str) -> int | None:
    """Start offset of ``Content-Range: bytes START-END/TOTAL``."""
    unit, _space, spec = content_range.partition(" ")
    start = spec.partition("-")[0]
    return int(start) if unit == "bytes" and start.isdigit() else None


def _apply(fd: int, wanted: Attributes, check_mode: bool = False) -> bool:
    """Give the open file its owner, group and mode; True when something changed (or would)."""
    found = os.fstat(fd)
    uid = -1 if wanted.uid is None or wanted.uid == found.st_uid else wanted.uid
    gid = -1 if wanted.gid is None or wanted.gid == found.st_gid else wanted.gid
    mode = None if wanted.mode is None or wanted.mode == stat.S_IMODE(found.st_mode) else wanted.mode
    if (uid, gid, mode) == (-1, -1, None):
        return False
    if not check_mode:
        if (uid, gid) != (-1, -1):
            os.fchown(fd, uid, gid)
        os.fchmod(fd, wanted.mode if wanted.mode is not None else stat.S_IMODE(found.st_mode))
    return True


def request_headers(params: dict[str, Any]) -> dict[str, str]:
    headers = {"User-Agent": "gguf_download"}
    headers.update({str(key): str(value) for key, value in (params.get("headers") or {}).items()})
    if params.get("token") and token_allowed(params["url"], params.get("token_hosts") or DEFAULT_TOKEN_HOSTS):
        headers["Authorization"] = f"Bearer {params['token']}"
    return headers


def fetch(params: dict[str, Any], folder: Folder, name: str, wanted: Attributes,
          check_mode: bool) -> dict[str, Any]:
    """Download and install ``dest`` (or say that it would, in check mode)."""
    url, sha256, timeout = params["url"], params["sha256"].lower(), params["timeout"]
    part = part_path(name)
    have = _part_size(folder, part)
    headers = request_headers(params)
    size = params["size"] if params.get("size") is not None else remote_size(url, headers, timeout)
    if size is not None:
        check_space(folder.path, size, have if have <= size else 0)
    if check_mode:
        return {"size": size, "resumed_from": have, "msg": f"would download {_redact(url)}"}
    transfer, fd = download(url, folder, name, headers, timeout, size)
    try:
        if transfer.sha256 != sha256:
            folder.unlink(part)
            raise DownloadError(
                f"Checksum mismatch for {_redact(url)}: expected sha256 {sha256}, got {transfer.sha256} "
                f"({transfer.size} bytes). The download was deleted and {folder.join(name)} left as it was: check "
                f"the sha256 and url of this file (a rerun downloads it from scratch)."
            )
        # The file gets its owner and mode before it appears under its final name.
        _apply(fd, wanted._replace(mode=NEW_FILE_MODE if wanted.mode is None else wanted.mode))
        os.fsync(fd)
    finally:
        os.close(fd)
    folder.replace(part, name)  # atomic: a crash leaves either the old or the new file
    folder.sync()
    _write_marker(folder, name, sha256)
    return {
        "size": transfer.size,
        "bytes_transferred": transfer.transferred,
        "resumed_from": transfer.resumed_from,
        "msg": f"downloaded {transfer.transferred} bytes"
        + (f", resumed from byte {transfer.resumed_from}" if transfer.resumed_from else ""),
    }


def _present(folder: Folder, name: str, sha256: str, wanted: Attributes, check_mode: bool,
             result: dict[str, Any]) -> bool:
    """Settle a file already at the final name; False when it has to be downloaded."""
    taken_over = False
    if _is_verified(folder, name, sha256):
        result["msg"] = "verified earlier (marker matches); not reread"
    else:
        found = folder.lstat(name)
        # A link or a hard-linked file is never hashed, chowned or trusted: the download replaces the name.
        if found is None or not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
            return False
        fd = folder.open(name, os.O_RDONLY | os.O_NONBLOCK)
        try:
            # Own it first, so nobody else can still change what is hashed next.
            if not check_mode and found.st_uid != os.geteuid():
                taken_over = _apply(fd, Attributes(os.geteuid() if wanted.uid is None else wanted.uid, wanted.gid,
                                                   wanted.mode))
            if _hash_fd(fd, hashlib.sha256()).hexdigest() != sha256:
                return False
        finally:
            os.close(fd)
        if not check_mode:
            _write_marker(folder, name, sha256)
        result["msg"] = "present with the expected sha256"
    fd = folder.open(name, os.O_RDONLY | os.O_NONBLOCK)
    try:
        changed = _apply(fd, wanted, check_mode)
    finally:
        os.close(fd)
    if changed and not check_mode:
        _write_marker(folder, name, sha256)  # a new owner voids the marker; vouch for the file as it is now
    found = folder.lstat(name)
    result.update(changed=changed or taken_over, size=found.st_size if found else 0)
    return True


def wanted_attributes(params: dict[str, Any]) -> Attributes:
    """Owner, group and mode from the module's options, as numbers."""
    uid = gid = mode = None
    try:
        if params.get("owner") not in (None, ""):
            owner = str(params["owner"])
            uid = int(owner) if owner.isdigit() else pwd.getpwnam(owner).pw_uid
        if params.get("group") not in (None, ""):
            group = str(params["group"])
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError as error:
        raise DownloadError(f"No such user or group on this box: {error.args[0]}; create it first.") from None
    if params.get("mode") not in (None, ""):
        raw = params["mode"]
        try:
            mode = raw if isinstance(raw, int) else int(str(raw), 8)
        except ValueError:
            raise DownloadError(f"mode must be octal such as '0640', got {raw!r}.") from None
        if mode & (stat.S_ISUID | stat.S_ISGID) or not 0 <= mode <= 0o7777:
            raise DownloadError(f"mode {raw!r} is refused: give plain permissions such as '0640'.")
    return Attributes(uid, gid, mode)


def ensure(params: dict[str, Any], check_mode: bool = False) -> dict[str, Any]:
    """Make ``dest`` hold the file with ``sha256``; the whole module short of Ansible's plumbing."""
    started = time.monotonic()
    dest, sha256 = params["dest"], params["sha256"].lower()
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise DownloadError(f"sha256 must be 64 hex digits, got {params['sha256']!r}.")
    wanted = wanted_attributes(params)
    result: dict[str, Any] = {"dest": dest, "sha256": sha256, "bytes_transferred": 0, "resumed_from": 0,
                              "waited": 0.0}
    folder_path, name = os.path.dirname(dest) or ".", os.path.basename(dest)
    if not os.path.lexists(folder_path) and check_mode:
        result.update(changed=True, size=params.get("size"),
                      msg=f"would download into {folder_path}, which does not exist yet")
    else:
        with Folder(folder_path) as folder:
            if check_mode:  # takes no lock: it writes nothing
                if not _present(folder, name, sha256, wanted, True, result):
                    result.update(fetch(params, folder, name, wanted, True), changed=True)
            else:
                with FileLock(folder, lock_path(name)) as lock:
                    result["waited"] = round(lock.waited, 3)
                    if not _present(folder, name, sha256, wanted, False, result):
                        result.update(fetch(params, folder, name, wanted, False), changed=True)
    result["elapsed"] = round(time.monotonic() - started, 3)
    return result


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "url": {"type": "str", "required": True},
            "dest": {"type": "path", "required": True},
            "sha256": {"type": "str", "required": True},
            "size": {"type": "int"},
            "token": {"type": "str", "no_log": True},
            "token_hosts": {"type": "list", "elements": "str", "default": list(DEFAULT_TOKEN_HOSTS), "no_log": False},
            "headers": {"type": "dict", "default": {}},
            "timeout": {"type": "int", "default": 60},
            "owner": {"type": "str"},
            "group": {"type": "str"},
            "mode": {"type": "raw"},
        },
        supports_check_mode=True,
    )
    try:
        result = ensure(module.params, module.check_mode)
    except DownloadError as error:
        module.fail_json(msg=str(error), dest=module.params["dest"])
    except OSError as error:
        module.fail_json(msg=f"{module.params['dest']}: {error.strerror or error}", dest=module.params["dest"])
    module.exit_json(**result)


if __name__ == "__main__":
    main()
