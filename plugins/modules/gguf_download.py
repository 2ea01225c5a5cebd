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
    when resuming), so a model is read once. O(dest) is replaced only after the hash matches; an older
    good file stays in place until then.
  - After a verified download a marker C(<dest>.verified) records hash, size and mtime, so later runs
    skip without rereading tens of gigabytes. A file without a valid marker is hashed once.
  - Before any byte is fetched, the free space of the folder must cover the missing bytes plus a
    64 MiB margin; the expected size comes from O(size) or the C(HEAD) C(Content-Length).
  - Redirects are followed. The C(Authorization) header (from O(token) or O(headers)) is sent only to
    the host of the previous hop. Model hubs redirect to a CDN with a signed URL that needs no token,
    and a token must not leak to another host.
options:
  url:
    description: HTTP(S) URL of the file.
    type: str
    required: true
  dest:
    description: Full path of the final file. Its folder must exist.
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
    description: Bearer token sent as C(Authorization) to the host of O(url). Never logged.
    type: str
  headers:
    description: Extra request headers. Put secrets in O(token), not here.
    type: dict
    default: {}
  timeout:
    description: Seconds to wait for a connection or for the next bytes before the transfer counts as interrupted.
    type: int
    default: 60
extends_documentation_fragment:
  - files
attributes:
  check_mode:
    support: full
    description: Reports whether a download would happen; fetches nothing, writes nothing.
author:
  - v100-llm-box
"""

EXAMPLES = r"""
- name: Download the Gemma model
  gguf_download:
    url: "https://models.example/google/gemma/resolve/main/gemma.gguf"
    dest: /var/lib/llama/models/gemma.gguf
    sha256: "{{ gemma_sha256 }}"
    size: "{{ gemma_size_bytes }}"
    token: "{{ hf_token | default(omit, true) }}"
    owner: llama
    group: llama
    mode: "0644"
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
elapsed:
  description: Seconds this run took.
  returned: always
  type: float
"""

import hashlib
import json
import os
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


def part_path(dest: str) -> str:
    return dest + ".part"


def marker_path(dest: str) -> str:
    return dest + ".verified"


def hash_file(path: str, digest: Any | None = None) -> Any:
    """Feed a local file into ``digest`` (a fresh SHA-256 by default) and return it."""
    digest = digest if digest is not None else hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(CHUNK):
            digest.update(chunk)
    return digest


def is_verified(dest: str, sha256: str) -> bool:
    """True when the marker vouches for ``dest`` as it is now: same hash, size and mtime.

    Trusting size+mtime avoids rereading a model on every run; anything that rewrites the file
    changes its mtime and sends it back through a full hash.
    """
    try:
        stat = os.stat(dest)
        with open(marker_path(dest), encoding="utf-8") as handle:
            marker = json.load(handle)
    except (OSError, ValueError):
        return False
    return marker == {
        "sha256": sha256,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }


def write_marker(dest: str, sha256: str) -> None:
    stat = os.stat(dest)
    marker = {"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    temporary = marker_path(dest) + ".tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(marker, handle)
    os.replace(temporary, marker_path(dest))


def free_bytes(folder: str) -> int:
    """Bytes an unprivileged writer may still use in ``folder`` (the boundary tests replace)."""
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


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


def _origin(url: str) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, parts.netloc.lower()


class _ScopedAuthRedirect(urllib.request.HTTPRedirectHandler):
    """Follow redirects, keep the method, and drop Authorization when the host changes."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is None:
            return None
        new.method = req.get_method()  # the stdlib turns a redirected HEAD into a GET
        if _origin(new.full_url) != _origin(req.full_url):
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
            401: "the server wants a token: set token (gguf_model_hf_token in the role)",
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


def _interrupted(part: str, reason: object) -> DownloadError:
    kept = os.path.getsize(part) if os.path.exists(part) else 0
    return DownloadError(
        f"Transfer interrupted ({reason}); {kept} bytes are kept in {part}: a rerun resumes from byte {kept}."
    )


def download(url: str, dest: str, headers: dict[str, str], timeout: float, size: int | None) -> Transfer:
    """Fetch ``url`` into ``<dest>.part``, resuming what is there; return the hash of the whole part.

    The partial bytes are hashed from local disk first, then the stream continues the same digest,
    so every byte is read once.
    """
    part = part_path(dest)
    have = os.path.getsize(part) if os.path.isfile(part) else 0
    if size is not None and have > size:  # longer than the file: not a prefix of it
        os.remove(part)
        have = 0
    digest = hashlib.sha256()
    if have:
        hash_file(part, digest)
    if have and have == size:  # a previous run got every byte but stopped before verifying
        return Transfer(digest.hexdigest(), have, 0, have)
    try:
        response = request(url, dict(headers, Range=f"bytes={have}-") if have else headers, timeout)
    except RangeNotSatisfiable:
        os.remove(part)  # the server's file is shorter than our part: it changed, start over
        return download(url, dest, headers, timeout, size)
    with response:
        if response.status == 206:
            start = _range_start(response.headers.get("Content-Range", ""))
            if start != have:
                raise DownloadError(
                    f"The server resumed at byte {start} instead of {have}: delete {part} and rerun."
                )
        else:  # 200: the server ignored the range, so the body is the whole file
            have, digest = 0, hashlib.sha256()
        length = response.headers.get("Content-Length", "")
        expected = have + int(length) if length.isdigit() else size
        if size is not None and expected is not None and expected != size:
            raise DownloadError(
                f"The server's file is {expected} bytes but size says {size}: correct size (or the url)."
            )
        try:
            with open(part, "ab" if have else "wb") as out:
                received = _pump(response, out, digest)
        except (OSError, HTTPException) as error:
            raise _interrupted(part, error) from None
    if expected is not None and have + received < expected:
        raise _interrupted(part, f"connection closed after {have + received} of {expected} bytes")
    return Transfer(digest.hexdigest(), have + received, received, have)


def _range_start(content_range: str) -> int | None:
    """Start offset of ``Content-Range: bytes START-END/TOTAL``."""
    unit, _, spec = content_range.partition(" ")
    start = spec.partition("-")[0]
    return int(start) if unit == "bytes" and start.isdigit() else None


def _durable_replace(part: str, dest: str) -> None:
    """Put the verified file in place so that a crash leaves either the old or the new file."""
    handle = os.open(part, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
    os.replace(part, dest)
    folder = os.open(os.path.dirname(dest) or ".", os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def request_headers(params: dict[str, Any]) -> dict[str, str]:
    headers = {"User-Agent": "gguf_download"}
    headers.update({str(key): str(value) for key, value in (params.get("headers") or {}).items()})
    if params.get("token"):
        headers["Authorization"] = f"Bearer {params['token']}"
    return headers


def fetch(params: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    """Download and install ``dest`` (or say that it would, in check mode)."""
    url, dest, sha256, timeout = params["url"], params["dest"], params["sha256"].lower(), params["timeout"]
    folder = os.path.dirname(dest) or "."
    part = part_path(dest)
    have = os.path.getsize(part) if os.path.isfile(part) else 0
    if not os.path.isdir(folder):
        if check_mode:
            return {
                "size": params.get("size"),
                "msg": f"would download into {folder}, which does not exist yet",
            }
        raise DownloadError(f"The folder {folder} does not exist: create it before downloading into it.")
    headers = request_headers(params)
    size = params["size"] if params.get("size") is not None else remote_size(url, headers, timeout)
    if size is not None:
        check_space(folder, size, have if have <= size else 0)
    if check_mode:
        return {"size": size, "resumed_from": have, "msg": f"would download {_redact(url)}"}
    transfer = download(url, dest, headers, timeout, size)
    if transfer.sha256 != sha256:
        os.remove(part)
        raise DownloadError(
            f"Checksum mismatch for {_redact(url)}: expected sha256 {sha256}, got {transfer.sha256} "
            f"({transfer.size} bytes). The download was deleted and {dest} left as it was: check the "
            f"sha256 and url of this file (a rerun downloads it from scratch)."
        )
    _durable_replace(part, dest)
    write_marker(dest, sha256)
    return {
        "size": transfer.size,
        "bytes_transferred": transfer.transferred,
        "resumed_from": transfer.resumed_from,
        "msg": f"downloaded {transfer.transferred} bytes"
        + (f", resumed from byte {transfer.resumed_from}" if transfer.resumed_from else ""),
    }


def ensure(params: dict[str, Any], check_mode: bool = False) -> dict[str, Any]:
    """Make ``dest`` hold the file with ``sha256``; the whole module short of Ansible's plumbing."""
    started = time.monotonic()
    dest, sha256 = params["dest"], params["sha256"].lower()
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise DownloadError(f"sha256 must be 64 hex digits, got {params['sha256']!r}.")
    result: dict[str, Any] = {"dest": dest, "sha256": sha256, "bytes_transferred": 0, "resumed_from": 0}
    if is_verified(dest, sha256):
        result.update(
            changed=False, size=os.path.getsize(dest), msg="verified earlier (marker matches); not reread"
        )
    elif os.path.isfile(dest) and hash_file(dest).hexdigest() == sha256:
        if not check_mode:
            write_marker(dest, sha256)
        result.update(changed=False, size=os.path.getsize(dest), msg="present with the expected sha256")
    else:
        result.update(fetch(params, check_mode), changed=True)
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
            "headers": {"type": "dict", "default": {}},
            "timeout": {"type": "int", "default": 60},
        },
        add_file_common_args=True,
        supports_check_mode=True,
    )
    try:
        result = ensure(module.params, module.check_mode)
    except DownloadError as error:
        module.fail_json(msg=str(error), dest=module.params["dest"])
    if os.path.exists(module.params["dest"]):
        file_args = module.load_file_common_arguments(module.params)
        result["changed"] = module.set_fs_attributes_if_different(file_args, result["changed"])
    module.exit_json(**result)


if __name__ == "__main__":
    main()
