#!/usr/bin/python
from __future__ import annotations

DOCUMENTATION = r"""
---
module: openpgp_fingerprint
short_description: Check that an OpenPGP key file holds exactly the key with the pinned fingerprint
description:
  - Reads an OpenPGP public key file (ASCII-armored or binary), computes the fingerprint of each primary key
    (v4 SHA-1, v5 and v6 SHA-256, as RFC 4880 and RFC 9580 define them) and fails unless the file holds exactly
    one primary key and its fingerprint is I(fingerprint).
  - Needs no gpg on the host (a Debian minbase system has only gpgv). Read-only.
  - A file holding a second key is refused too, because apt's C(signed-by) would trust every key in the file.
options:
  path:
    description: The key file on the host.
    type: path
    required: true
  fingerprint:
    description: Expected fingerprint, hexadecimal; spaces and case are ignored.
    type: str
    required: true
  name:
    description: What the key signs, for the failure message.
    type: str
    default: the repository
author: v100box maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Check the CUDA repository key before trusting it
  v100box.llm.openpgp_fingerprint:
    path: /etc/apt/keyrings/nvidia-cuda.asc.download
    fingerprint: EB693B3035CD5710E231E123A4B469963BF863CC
"""

RETURN = r"""
fingerprints:
  description: Fingerprints of the primary keys in the file, upper-case hexadecimal.
  type: list
  elements: str
  returned: when the file could be read
armored:
  description: Whether the file is ASCII-armored (apt wants such a keyring named C(.asc), a binary one C(.gpg)).
  type: bool
  returned: success
"""

import base64
import binascii
import hashlib
import re

from ansible.module_utils.basic import AnsibleModule

PUBLIC_KEY = 6
ARMOR_BEGIN = re.compile(r"^-----BEGIN PGP PUBLIC KEY BLOCK-----[ \t\r]*$", re.M)
ARMOR_END = re.compile(r"^-----END PGP PUBLIC KEY BLOCK-----[ \t\r]*$", re.M)


class NotAKey(ValueError):
    """The file is not an OpenPGP public key."""


def dearmor(data: bytes) -> bytes:
    """The binary packets of an ASCII-armored key, or the data itself when it is binary already."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return data
    begin = ARMOR_BEGIN.search(text)
    if not begin:
        if text.lstrip().startswith("-----"):
            raise NotAKey("an ASCII-armored block that is not a PGP PUBLIC KEY BLOCK")
        return data
    end = ARMOR_END.search(text, begin.end())
    if not end:
        raise NotAKey("an ASCII-armored key without its END line")
    body = [line.strip() for line in text[begin.end():end.start()].splitlines()[1:]]
    # Armor headers ("Comment: ...") end with the first empty line; base64 data has no empty line.
    if "" in body:
        body = body[body.index("") + 1:]
    lines = [line for line in body if line and not line.startswith("=")]  # "=" starts the CRC line
    try:
        return base64.b64decode("".join(lines), validate=True)
    except (binascii.Error, ValueError) as err:
        raise NotAKey(f"armored data that is not base64 ({err})") from None


def packets(data: bytes):
    """Yield (tag, body) for each OpenPGP packet (old and new formats)."""
    pos = 0
    while pos < len(data):
        header = data[pos]
        if not header & 0x80:
            raise NotAKey(f"bytes that are not OpenPGP packets (offset {pos})")
        if header & 0x40:  # new format
            tag = header & 0x3F
            pos += 1
            if pos >= len(data):
                raise NotAKey("a truncated packet header")
            first = data[pos]
            if first < 192:
                length, pos = first, pos + 1
            elif first < 224:
                if pos + 1 >= len(data):
                    raise NotAKey("a truncated packet header")
                length, pos = ((first - 192) << 8) + data[pos + 1] + 192, pos + 2
            elif first == 255:
                length, pos = int.from_bytes(data[pos + 1:pos + 5], "big"), pos + 5
            else:
                raise NotAKey("a partial-length packet, which key files never use")
        else:  # old format
            tag = (header >> 2) & 0x0F
            kind = header & 0x03
            if kind == 3:
                raise NotAKey("an indeterminate-length packet, which key files never use")
            size = (1, 2, 4)[kind]
            length = int.from_bytes(data[pos + 1:pos + 1 + size], "big")
            pos += 1 + size
        if pos + length > len(data):
            raise NotAKey("a truncated packet")
        yield tag, data[pos:pos + length]
        pos += length


def fingerprint(body: bytes) -> str:
    """The fingerprint of a public key packet body."""
    version = body[0] if body else 0
    if version == 4:
        digest = hashlib.sha1(b"\x99" + len(body).to_bytes(2, "big") + body).hexdigest()  # noqa: S324
    elif version in (5, 6):
        digest = hashlib.sha256(bytes([0x95 + version]) + len(body).to_bytes(4, "big") + body).hexdigest()
    else:
        raise NotAKey(f"a version {version} public key, which no current tool writes")
    return digest.upper()


def primary_fingerprints(data: bytes) -> list[str]:
    found = [fingerprint(body) for tag, body in packets(dearmor(data)) if tag == PUBLIC_KEY]
    if not found:
        raise NotAKey("no public key")
    return found


def normalise(value: str) -> str:
    return re.sub(r"\s+", "", value).upper().removeprefix("0X")


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "fingerprint": {"type": "str", "required": True},
            "name": {"type": "str", "default": "the repository"},
        },
        supports_check_mode=True,
    )
    path, name = module.params["path"], module.params["name"]
    wanted = normalise(module.params["fingerprint"])
    if not re.fullmatch(r"[0-9A-F]{40}|[0-9A-F]{64}", wanted):
        module.fail_json(msg=f"fingerprint {module.params['fingerprint']!r} for {name}: give the key's full fingerprint, "
                             "40 hexadecimal digits (64 for a v6 key), as `gpg --show-keys` prints it")
    try:
        with open(path, "rb") as handle:
            data = handle.read(1 << 20)
    except OSError as err:
        module.fail_json(msg=f"cannot read the signing key of {name} at {path}: {err.strerror}")
    try:
        found = primary_fingerprints(data)
    except NotAKey as err:
        module.fail_json(msg=f"the signing key of {name} ({path}) is not usable: it holds {err}")
    if found != [wanted]:
        module.fail_json(
            msg=f"the signing key of {name} has fingerprint {', '.join(found)}, not the pinned {wanted}: the key "
                "was not trusted and nothing was changed. Check the key's source; if the repository really changed "
                "its key, pin the new fingerprint.",
            fingerprints=found,
        )
    module.exit_json(changed=False, fingerprints=found, armored=ARMOR_BEGIN.search(data.decode("latin-1")) is not None)


if __name__ == "__main__":
    main()
