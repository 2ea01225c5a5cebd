"""The fleet file: which boxes exist, how to reach them, and what each should serve.

Example::

    defaults:
      user: root
      key: ~/.ssh/id_ed25519
    boxes:
      box3:
        address: 192.0.2.10
        os: linux
        models:
          - id: qwen3.6-35b-a3b-iq4_xs
            ctx: 65536
            agents: 2

Secrets are never written in the fleet file; it names where to find them (an environment variable
or a file), and the controller hands them to Ansible outside the inventory and artifacts.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from controller.catalog import Name
from controller.errors import FleetError
from controller.facts import (
    DEFAULT_MODEL_DIR,
    DRIVER_BRANCHES,
    DRIVER_DEFAULT_BRANCH,
    DRIVER_FIRST_MAJOR,
    DRIVER_LAST_MAJOR,
    DRIVER_WINDOW,
)

BOX_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Secret(_Strict):
    """Where a secret lives: exactly one of an environment variable or a file."""

    env: str | None = None
    file: Path | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Secret:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of 'env' (a variable name) or 'file' (a path)")
        return self

    def resolve(self, what: str) -> str:
        if self.env is not None:
            value = os.environ.get(self.env)
            if not value:
                raise FleetError(f"{what}: environment variable {self.env} is not set; export it or use 'file:'")
            return value
        path = self.file.expanduser()
        try:
            value = path.read_text().strip()
        except OSError as exc:
            raise FleetError(f"{what}: cannot read secret file {path}: {exc.strerror}") from None
        if not value:
            raise FleetError(f"{what}: secret file {path} is empty")
        return value


class WantedModel(_Strict):
    id: Name  # a catalog model id: a plain name, checked against the catalog before any connection
    ctx: int | None = Field(default=None, ge=512)
    agents: int = Field(default=1, ge=1, le=64)


class Mirror(_Strict):
    """Base URLs to fetch from instead of the catalog's own addresses (a LAN mirror, or the lab)."""

    engines: str | None = None  # engine packs and SHA256SUMS; on Windows also WinSW-x64.exe
    models: str | None = None
    models_token: bool = False  # also send hf_token to the models mirror (HTTPS only); default: the hub only
    drivers: str | None = None  # Linux: the NVIDIA package repository; Windows: the folder with the installer
    drivers_key: str | None = None  # Linux: URL of that repository's signing key (apt signed-by, dnf gpgkey)
    drivers_trusted: bool = False  # Linux: trust that repository without a key (a local mirror you control)
    drivers_key_fingerprint: str | None = None  # Linux: full fingerprint drivers_key must have (required with it)

    @field_validator("drivers_key_fingerprint")
    @classmethod
    def _full_fingerprint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        compact = value.replace(" ", "").upper()
        if not re.fullmatch(r"[0-9A-F]{40}|[0-9A-F]{64}", compact):
            raise ValueError(f"{value!r} is not a full key fingerprint: give the 40 hex digits `gpg --show-keys` prints")
        return compact


class DriverSettings(_Strict):
    """How the NVIDIA driver is handled on a box with V100s."""

    manage: bool = True  # false: leave the driver alone (the box's owner handles it)
    branch: int = Field(default=DRIVER_DEFAULT_BRANCH, description=f"Linux driver branch, {DRIVER_WINDOW}")
    allow_reboot: bool = False  # a driver change or a TCC/MCDM switch may reboot the box
    wsl2: bool = False  # Windows box used through WSL2: MCDM instead of TCC (slower decode)

    @field_validator("branch")
    @classmethod
    def _in_window(cls, value: int) -> int:
        last = DRIVER_BRANCHES[-1]
        if value > DRIVER_LAST_MAJOR:
            raise ValueError(f"R{value} and later dropped Volta (sm_70): the V100 is not supported there; "
                             f"use {last}, the last branch with Volta")
        if not DRIVER_BRANCHES[0] <= value <= last:
            raise ValueError(f"R{value} is outside the {DRIVER_WINDOW} window (the CUDA 12.8 builds need "
                             f"R{DRIVER_FIRST_MAJOR} or newer); use " + " or ".join(map(str, DRIVER_BRANCHES)))
        return value


class Box(_Strict):
    name: str = Field(pattern=BOX_NAME_PATTERN)
    address: str
    transport: Literal["ssh", "winrm", "local"] = "ssh"
    port: int | None = Field(default=None, ge=1, le=65535)
    user: str = "root"
    key: Path | None = None
    host_key: str | None = None  # the box's SSH host public key ("ssh-ed25519 AAAA..."); unset: trust on first use
    password: Secret | None = None
    os: Literal["linux", "windows"] = "linux"
    become: bool = True
    models: list[WantedModel] = Field(default_factory=list)
    model_dir: str | None = None
    bind: str = "127.0.0.1"
    allow_from: list[str] = Field(default_factory=list)  # networks (CIDR) that may reach a server bound beyond loopback
    base_port: int = Field(default=8001, ge=1024, le=65000)
    api_key: Secret | None = None
    hf_token: Secret | None = None
    mirror: Mirror = Field(default_factory=Mirror)
    driver: DriverSettings = Field(default_factory=DriverSettings)
    winrm_scheme: Literal["https", "http"] = "https"
    winrm_transport: Literal["ntlm", "kerberos", "basic", "credssp"] = "ntlm"
    winrm_insecure_skip_verify: bool = False
    vars: dict[str, Any] = Field(default_factory=dict)  # extra Ansible variables for this box

    @field_validator("bind")
    @classmethod
    def _bind_is_an_address(cls, value: str) -> str:
        ipaddress.ip_address(value)
        return value

    @field_validator("allow_from")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        return [str(ipaddress.ip_network(item, strict=False)) for item in value]

    @model_validator(mode="after")
    def _exposure_names_its_networks(self) -> Box:
        if self.binds_beyond_loopback and not self.allow_from:
            raise ValueError(f"bind {self.bind} reaches beyond this box: list the networks that may connect in "
                             "allow_from (e.g. [192.168.1.0/24]), or bind 127.0.0.1")
        return self

    @field_validator("model_dir")
    @classmethod
    def _local_model_dir(cls, value: str | None) -> str | None:
        if value and value.startswith(("\\\\", "//")):
            raise ValueError(f"{value} is a network path (UNC or \\\\wsl$); the engine reads models at disk "
                             "speed only from a local volume: use a local path such as D:\\llama\\models")
        return value

    @model_validator(mode="after")
    def _windows_model_dir_on_a_drive(self) -> Box:
        if self.os == "windows" and self.model_dir and not re.match(r"^[A-Za-z]:[\\/]", self.model_dir):
            raise ValueError(f"model_dir {self.model_dir}: on Windows give a local drive path such as "
                             "D:\\llama\\models (models must sit on a local NTFS volume)")
        return self

    @model_validator(mode="after")
    def _driver_mirror_is_signed(self) -> Box:
        mirror = self.mirror
        if self.os == "linux" and mirror.drivers and not (mirror.drivers_key or mirror.drivers_trusted):
            raise ValueError(f"mirror.drivers {mirror.drivers}: give mirror.drivers_key (the URL of its signing "
                             "key), or set mirror.drivers_trusted: true for a local mirror you trust without one")
        if self.os == "linux" and mirror.drivers_key and not mirror.drivers_key_fingerprint:
            raise ValueError(f"mirror.drivers_key {mirror.drivers_key}: pin it with mirror.drivers_key_fingerprint "
                             "(the 40 hex digits `gpg --show-keys KEYFILE` prints), so no other key is trusted")
        return self

    @property
    def effective_port(self) -> int:
        if self.port is not None:
            return self.port
        if self.transport == "winrm":
            return 5986 if self.winrm_scheme == "https" else 5985
        return 22

    @property
    def effective_model_dir(self) -> str:
        if self.model_dir:
            return self.model_dir.replace("/", "\\") if self.os == "windows" else self.model_dir
        return DEFAULT_MODEL_DIR[self.os]

    @property
    def binds_beyond_loopback(self) -> bool:
        return not ipaddress.ip_address(self.bind).is_loopback


class Fleet(_Strict):
    boxes: dict[str, Box]
    catalogs: list[Path] = Field(default_factory=list)  # extra model catalogs, merged over the built-in one
    source: Path | None = Field(default=None, exclude=True)

    def box(self, name: str) -> Box:
        try:
            return self.boxes[name]
        except KeyError:
            known = ", ".join(sorted(self.boxes)) or "none"
            raise FleetError(f"{self.source or 'fleet'}: no box named {name!r} (boxes: {known})") from None

    def check_models_known(self, box: Box, known: Collection[str]) -> None:
        """Refuse a model id the catalog lacks; called before any connection to the box."""
        for wanted in box.models:
            if wanted.id not in known:
                raise FleetError(f"{self.source or 'fleet'}: box {box.name!r}: unknown model id {wanted.id!r}; "
                                 f"the catalog has: {', '.join(sorted(known))}")


def _merge_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    defaults = raw.pop("defaults", None) or {}
    if not isinstance(defaults, dict):
        raise ValueError("'defaults' must be a mapping")
    boxes = raw.get("boxes")
    if isinstance(boxes, dict):
        raw["boxes"] = {
            name: {**defaults, **(body or {}), "name": name} if isinstance(body, dict) or body is None else body
            for name, body in boxes.items()
        }
    return raw


def _describe(error: ValidationError, source: Path) -> str:
    lines = []
    for item in error.errors():
        loc = list(item["loc"])
        where = ""
        if len(loc) >= 2 and loc[0] == "boxes":
            where = f"box {loc[1]!r}, "
            loc = loc[2:]
        field = ".".join(str(part) for part in loc) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown field (check the spelling; see the fleet file reference in README.md)"
        lines.append(f"{source}: {where}field {field!r}: {message}")
    return "\n".join(lines)


def parse_fleet(data: Any, source: Path) -> Fleet:
    if not isinstance(data, dict):
        raise FleetError(f"{source}: expected a mapping with a 'boxes' key at the top level")
    base = source.parent
    try:
        fleet = Fleet.model_validate(_merge_defaults(dict(data)))
    except ValueError as exc:  # ValidationError is a ValueError
        if isinstance(exc, ValidationError):
            raise FleetError(_describe(exc, source)) from None
        raise FleetError(f"{source}: {exc}") from None
    fleet.source = source
    fleet.catalogs = [path if path.is_absolute() else base / path for path in fleet.catalogs]
    for box in fleet.boxes.values():
        if box.key is not None and not box.key.is_absolute() and not str(box.key).startswith("~"):
            box.key = base / box.key
    return fleet


def load_fleet(path: Path) -> Fleet:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise FleetError(f"{path}: cannot read fleet file: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise FleetError(f"{path}: not UTF-8 text (byte {exc.start}); save the fleet file as UTF-8") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise FleetError(f"{path}: not valid YAML: {exc}") from None
    return parse_fleet(data, path)
