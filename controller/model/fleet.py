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
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from controller.errors import FleetError
from controller.model.catalog import Name
from controller.model.inputs import (
    FLEET_MAX_BYTES,
    MAX_CTX,
    MAX_GPU_INDEX,
    SECRET_MAX_BYTES,
    load_yaml,
    read_bounded,
    read_text,
)
from controller.model.rules import (
    AGENT_CLIENT_CTX,
    DEFAULT_MODEL_DIR,
    DRIVER_BRANCHES,
    DRIVER_DEFAULT_BRANCH,
    DRIVER_FIRST_MAJOR,
    DRIVER_LAST_MAJOR,
    DRIVER_WINDOW,
    AgentClient,
)

BOX_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
RESERVED_GROUPS = frozenset({"all", "ungrouped", "linux", "windows"})  # groups hosts.yml makes itself


def _address(value: str) -> str:
    ipaddress.ip_address(value)
    return value


def _networks(value: list[str]) -> list[str]:
    return [str(ipaddress.ip_network(item, strict=False)) for item in value]


BindAddress = Annotated[str, AfterValidator(_address)]  # an IP address a server binds
Networks = Annotated[list[str], AfterValidator(_networks)]  # CIDR networks, normalised


# The servers read the key as one line of a key file and compare it byte for byte with the header a
# client sends; HTTP drops spaces around header values and upstream skips key lines starting with "#".
# The same rule is checked by roles/llama_service (preflight) for hand-written inventories.
API_KEY_RULE = re.compile(r"[!-~]{16,256}")


def check_api_key(key: str, what: str) -> str:
    if not API_KEY_RULE.fullmatch(key) or key.startswith("#"):
        raise FleetError(f"{what}: use 16 to 256 printable ASCII characters with no spaces (letters, digits, "
                         f"punctuation; not starting with #); the key given has {len(key)} characters"
                         + ("" if API_KEY_RULE.fullmatch(key) else " and some outside that set"))
    return key


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
            value = read_bounded(path, SECRET_MAX_BYTES).decode("utf-8").strip()
        except OSError as exc:
            raise FleetError(f"{what}: cannot read secret file {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise FleetError(f"{what}: secret file {path} is not UTF-8 text (byte {exc.start})") from None
        if not value:
            raise FleetError(f"{what}: secret file {path} is empty")
        return value


class WantedModel(_Strict):
    id: Name  # a catalog model id: a plain name, checked against the catalog before any connection
    ctx: int | None = Field(default=None, ge=512, le=MAX_CTX)
    agents: int = Field(default=1, ge=1, le=64)  # concurrent agents: --parallel N with one shared KV cache
    # The agent clients that will use the service; `agents: [claude-code, openclaw]` in the fleet file
    # sets this and one slot per client. The planner never plans a context below what they need.
    clients: list[AgentClient] = Field(default_factory=list)
    # A draft model for speculative decoding: a catalog id, or "auto" for the catalog's recommendation when
    # it fits; absent, no draft.
    draft: Name | None = None
    # An exact engine id (a pack of the engine catalog) to serve this model with, instead of the catalog's
    # choice; the planner refuses it when its cuda_archs run on none of the box's cards.
    engine: Name | None = None
    # Allow this model to span cards of different architectures (a V100 with an RTX 3090), or cards joined
    # only by PCIe, layer split, when no NVLink board of one kind holds it. Off: one kind, one board.
    mix_cards: bool = False
    # Where it runs, when the operator says so: these cards by nvidia-smi index (all of them), or the Nth NVLink
    # board as `controller probe` numbers them (its fewest cards that hold the model). The planner places it
    # there or refuses it with the numbers; it never moves a pinned model elsewhere.
    gpus: list[Annotated[int, Field(ge=0, le=MAX_GPU_INDEX)]] | None = Field(default=None, min_length=1)
    board: int | None = Field(default=None, ge=0, le=MAX_GPU_INDEX)
    # A model no single board holds whole: "host" keeps it inside one board and runs the experts that do not fit
    # on the CPU (mixture-of-experts models), "boards" splits it by layer across the fewest boards, every token
    # crossing PCIe between them. Unset: host where one board can hold it so, else boards.
    spill: Literal["host", "boards"] | None = None
    # Served on demand: true (the box's one group) or a group's name. A group's models share one server in
    # router mode, one port and one key, on the same cards; each is loaded when a request names it and the least
    # recently used is unloaded when the next does not fit.
    on_demand: bool | Name = False

    @property
    def group(self) -> str | None:
        """The on-demand group's name (``default`` for ``on_demand: true``), or None."""
        if self.on_demand is False:
            return None
        return "default" if self.on_demand is True else str(self.on_demand)

    @field_validator("gpus")
    @classmethod
    def _cards_once(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(set(value)) != len(value):
            twice = sorted({index for index in value if value.count(index) > 1})
            raise ValueError(f"GPU {', '.join(map(str, twice))} is listed twice; name each card once")
        return value

    @model_validator(mode="after")
    def _one_pin(self) -> WantedModel:
        if self.gpus is not None and self.board is not None:
            raise ValueError("give gpus or board, not both: gpus names the cards, board the NVLink board whose cards "
                             "it may take")
        if self.spill == "boards" and self.pinned:
            raise ValueError("spill: boards lets the planner split the model across boards, but it is pinned "
                             f"({self.pinned}); drop the pin or the spill")
        return self

    @property
    def pinned(self) -> str | None:
        """The pin as the fleet wrote it (``gpus [4, 5]``, ``board 2``), or None."""
        if self.gpus is not None:
            return f"gpus {self.gpus}"
        return None if self.board is None else f"board {self.board}"

    @model_validator(mode="before")
    @classmethod
    def _agents_by_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("agents"), list):
            named = data["agents"]
            if not named:
                raise ValueError("agents: give a count or the clients that will use the model, e.g. "
                                 "[claude-code, openclaw]")
            unknown = [str(name) for name in named if name not in AGENT_CLIENT_CTX]
            if unknown:
                raise ValueError(f"agents: unknown client {', '.join(unknown)}; name "
                                 f"{' or '.join(AGENT_CLIENT_CTX)}, or give a count of concurrent agents")
            data = {**data, "agents": len(named), "clients": list(dict.fromkeys(named))}
        return data

    @model_validator(mode="after")
    def _ctx_serves_the_clients(self) -> WantedModel:
        for client in self.clients:
            least = AGENT_CLIENT_CTX[client][0]
            if self.ctx is not None and self.ctx < least:
                raise ValueError(f"ctx {self.ctx} is below the {least} tokens {client} needs; raise ctx to at least "
                                 f"{least} or leave it out (the planner then picks the largest that fits)")
        return self


class Mirror(_Strict):
    """Base URLs to fetch from instead of the catalog's own addresses (a LAN mirror, or the lab)."""

    engines: str | None = None  # engine packs and SHA256SUMS; on Windows also WinSW-x64.exe
    models: str | None = None
    models_token: bool = False  # also send hf_token to the models mirror (HTTPS only); default: the hub only
    drivers: str | None = None  # Linux: the NVIDIA package repository; Windows: the folder with the installer
    drivers_key: str | None = None  # Linux: URL of that repository's signing key (apt signed-by, dnf gpgkey)
    drivers_trusted: bool = False  # Linux: trust that repository without a key (a local mirror you control)
    drivers_key_fingerprint: str | None = None  # Linux: full fingerprint drivers_key must have (required with it)
    # The fleet's LAN cache as this box reaches it (set from the fleet's `cache:`, never written per box).
    _cache: CacheRoute | None = PrivateAttr(default=None)

    @property
    def cache(self) -> CacheRoute | None:
        return self._cache

    @field_validator("drivers_key_fingerprint")
    @classmethod
    def _full_fingerprint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        compact = value.replace(" ", "").upper()
        if not re.fullmatch(r"[0-9A-F]{40}|[0-9A-F]{64}", compact):
            raise ValueError(f"{value!r} is not a full key fingerprint: give the 40 hex digits `gpg --show-keys` prints")
        return compact


class LanCache(_Strict):
    """A model and engine-pack cache on the LAN: one box of the fleet runs nginx, fills itself from the upstream
    addresses once, and the other boxes fetch through it (their mirror for model files and engine packs).

    The controller host serves as the cache when it is a box of the fleet (``transport: local``).
    """

    host: str  # the box that runs the cache
    address: str | None = None  # where the boxes reach it; default: the host box's address
    port: int = Field(default=8090, ge=1024, le=65535)
    bind: BindAddress = "0.0.0.0"
    # Networks that may fetch from the cache; default: the fleet boxes' addresses (and loopback).
    allow_from: Networks = Field(default_factory=list)
    models: str | None = None  # upstream of the model files (a hub or mirror base); unset: models are not cached
    engines: str | None = None  # upstream of the engine packs; unset: packs are not cached
    # When the cache does not answer, a box fetches from the upstream address instead (its report says so);
    # false: provisioning stops at the first download and names the cache host.
    fallback: bool = False

    @field_validator("models", "engines")
    @classmethod
    def _http_upstream(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/]+", value):
            raise ValueError(f"{value!r} is not an http(s) address: give the upstream base URL, e.g. https://host/path")
        return None if value is None else value.rstrip("/")


class CacheServer(_Strict):
    """What the cache host's nginx listens on and whom it serves."""

    bind: str
    port: int
    allow_from: list[str]


class CacheRoute(_Strict):
    """How one box uses the fleet's LAN cache: resolved from ``LanCache`` by the fleet, read by the planner."""

    host: str  # the cache host's box name, for messages and the report
    url: str  # http://address:port
    fallback: bool
    models: str | None  # upstream bases; None: that kind is not cached
    engines: str | None
    serve: CacheServer | None = None  # set on the cache host only: what its nginx listens on and lets in

    @property
    def health_url(self) -> str:
        return f"{self.url}/healthz"


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


class GatewaySettings(_Strict):
    """A gateway on this box: one OpenAI and one Anthropic endpoint routing by model name to planned services.

    It binds the box's ``bind`` (beyond loopback only with ``allow_from``, like the servers) and always
    asks for its own key. ``boxes`` names other boxes of the fleet whose services it also routes to.
    """

    port: int = Field(default=8000, ge=1024, le=65535)
    metrics_port: int = Field(default=8404, ge=1024, le=65535)  # Prometheus metrics, on loopback only
    api_key: Secret
    boxes: list[str] = Field(default_factory=list)


SSH_PUBLIC_KEY = re.compile(r"(?:ssh-(?:ed25519|rsa|dss)|ecdsa-sha2-nistp(?:256|384|521)|sk-ssh-ed25519@openssh\.com"
                            r"|sk-ecdsa-sha2-nistp256@openssh\.com) [A-Za-z0-9+/]+={0,3}(?: [^\n\r]*)?")


class SealSettings(_Strict):
    """What ``controller seal`` leaves on the box for its buyer."""

    # The buyer's SSH public keys ("ssh-ed25519 AAAA... comment"): the only keys left on the box, in root's
    # authorized_keys and the buyer account's. Empty: no key is left; the buyer logs in at the console first.
    buyer_authorized_keys: list[str] = Field(default_factory=list)
    # An account left for the buyer (created when missing; it may be the connection user): only the buyer's keys,
    # no password, and sudo only with buyer_sudo. Unset: the connection user is removed with its sudo rules.
    buyer_account: str | None = Field(default=None, pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    buyer_sudo: bool = False  # the buyer account may run anything as root (sudo, no password: it has none)

    @field_validator("buyer_authorized_keys")
    @classmethod
    def _public_keys(cls, value: list[str]) -> list[str]:
        for key in value:
            if not SSH_PUBLIC_KEY.fullmatch(key.strip()):
                shown = key.strip()[:40]
                raise ValueError(f"{shown!r} is not an SSH public key line: give one line of a .pub file, "
                                 "e.g. 'ssh-ed25519 AAAA... buyer@laptop'")
        return [key.strip() for key in value]

    @model_validator(mode="after")
    def _buyer_account_can_log_in(self) -> SealSettings:
        if self.buyer_account == "root":
            raise ValueError("buyer_account: root is always left to the buyer (with buyer_authorized_keys); name "
                             "another account, or leave buyer_account out")
        if self.buyer_account is not None and not self.buyer_authorized_keys:
            raise ValueError(f"buyer_account {self.buyer_account} needs buyer_authorized_keys: the seal locks its "
                             "password, so only the buyer's SSH keys open it")
        if self.buyer_sudo and self.buyer_account is None:
            raise ValueError("buyer_sudo needs buyer_account: the account that gets the sudo rule")
        return self


class ThermalSettings(_Strict):
    """The box's thermal guard (roles/thermal_guard): warn, stop the llama services, start them again when cooled."""

    guard: bool | None = None  # unset: a guard on a box whose plan puts a service on a GPU
    warn_c: int = Field(default=80, ge=40, le=110)
    stop_c: int = Field(default=85, ge=40, le=110)
    resume_c: int = Field(default=75, ge=30, le=110)
    memory_warn_c: int = Field(default=85, ge=40, le=110)  # HBM, where the driver reports temperature.memory
    memory_stop_c: int = Field(default=90, ge=40, le=110)
    interval_s: float = Field(default=5, gt=0, le=300)
    max_restarts: int = Field(default=3, ge=0, le=100)  # starts again within a rolling hour; then they stay stopped

    @model_validator(mode="after")
    def _levels_in_order(self) -> ThermalSettings:
        if self.stop_c <= self.warn_c:
            raise ValueError(f"stop_c {self.stop_c} must be above warn_c {self.warn_c} (the services stop after the "
                             f"warning); raise stop_c or lower warn_c")
        if self.resume_c >= self.warn_c:
            raise ValueError(f"resume_c {self.resume_c} must be below warn_c {self.warn_c} (the services start again "
                             f"once cooled below the warning); lower resume_c")
        if self.memory_stop_c <= self.memory_warn_c:
            raise ValueError(f"memory_stop_c {self.memory_stop_c} must be above memory_warn_c {self.memory_warn_c}; "
                             f"raise memory_stop_c or lower memory_warn_c")
        return self


def _power_limit(value: Any) -> Any:
    """One number of watts, or {gpu_index: watts}: checked here so that a wrong value is one line."""
    def watts(item: Any, where: str) -> int:
        if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= 1000:
            raise ValueError(f"{where}{item!r} is not a power limit: give whole watts from 1 to 1000 (the card's own "
                             f"range is checked on the box)")
        return item

    if value is None:
        return None
    if isinstance(value, dict):
        limits = {}
        for gpu, item in value.items():
            index = int(gpu) if isinstance(gpu, str) and gpu.isdigit() else gpu
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= MAX_GPU_INDEX:
                raise ValueError(f"GPU {gpu!r} is not a GPU index (0 to {MAX_GPU_INDEX}): give {{index: watts}}, e.g. "
                                 "{0: 150, 1: 150}")
            limits[index] = watts(item, f"GPU {index}: ")
        return limits
    return watts(value, "")


class Connection(_Strict):
    """How the controller reaches a machine of the fleet (a box or a workstation): one set of fields for both."""

    name: str = Field(pattern=BOX_NAME_PATTERN)
    address: str
    transport: Literal["ssh", "winrm", "local"] = "ssh"
    port: int | None = Field(default=None, ge=1, le=65535)
    user: str = "root"
    key: Path | None = None
    host_key: str | None = None  # the machine's SSH host public key ("ssh-ed25519 AAAA..."); unset: trust on first use
    password: Secret | None = None
    os: Literal["linux", "windows"] = "linux"
    become: bool = True
    winrm_scheme: Literal["https", "http"] = "https"
    winrm_transport: Literal["ntlm", "kerberos", "basic", "credssp"] = "ntlm"
    winrm_insecure_skip_verify: bool = False

    @property
    def effective_port(self) -> int:
        if self.port is not None:
            return self.port
        if self.transport == "winrm":
            return 5986 if self.winrm_scheme == "https" else 5985
        return 22


class Box(Connection):
    models: list[WantedModel] = Field(default_factory=list)
    # Who uses every model of the box (a count or client names), unless a model says otherwise.
    agents: int | list[AgentClient] | None = None
    model_dir: str | None = None
    bind: BindAddress = "127.0.0.1"
    allow_from: Networks = Field(default_factory=list)  # networks (CIDR) that may reach a server bound beyond loopback
    base_port: int = Field(default=8001, ge=1024, le=65000)
    api_key: Secret | None = None
    hf_token: Secret | None = None
    mirror: Mirror = Field(default_factory=Mirror)
    driver: DriverSettings = Field(default_factory=DriverSettings)
    gateway: GatewaySettings | None = None  # run a gateway on this box (Linux)
    thermal: ThermalSettings = Field(default_factory=ThermalSettings)
    # GPU power limits in watts (Linux): one for every GPU, or {gpu_index: watts}; checked against each card's
    # range on the box before anything is set.
    power_limit_w: Annotated[int | dict[int, int] | None, BeforeValidator(_power_limit)] = None
    seal: SealSettings = Field(default_factory=SealSettings)  # what `controller seal` leaves for the buyer
    # At most this many models of an on-demand group loaded at once (default: as many as fit the group's cards).
    on_demand_max: int | None = Field(default=None, ge=1, le=64)
    vars: dict[str, Any] = Field(default_factory=dict)  # extra Ansible variables for this box

    @field_validator("agents", mode="before")
    @classmethod
    def _agents_count(cls, value: Any) -> Any:
        """One line for a wrong ``agents:``, instead of one per member of the union it may be."""
        if value is None:
            return None
        if isinstance(value, list):
            unknown = [str(name) for name in value if name not in AGENT_CLIENT_CTX]
            if unknown:
                raise ValueError(f"unknown client {', '.join(unknown)}; name {' or '.join(AGENT_CLIENT_CTX)}, or give a "
                                 "count of concurrent agents")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= 64 or value % 1:
            raise ValueError(f"{value!r} is not a number of agents: give 1 to 64 concurrent agents, or the clients "
                             "that will use the models, e.g. [claude-code, openclaw]")
        return value

    @model_validator(mode="after")
    def _box_agents_for_every_model(self) -> Box:
        if self.agents is None:
            return self
        for i, wanted in enumerate(self.models):
            if not {"agents", "clients"} & wanted.model_fields_set:
                self.models[i] = WantedModel.model_validate({**wanted.model_dump(exclude_unset=True),  # draft, engine
                                                             "agents": self.agents})
        return self

    @model_validator(mode="after")
    def _groups_agree_on_their_cards(self) -> Box:
        groups: dict[str, list[WantedModel]] = {}
        for wanted in self.models:
            if wanted.group is not None:
                groups.setdefault(wanted.group, []).append(wanted)
        for name, members in groups.items():
            pins = {(tuple(m.gpus or ()), m.board, m.spill, m.mix_cards) for m in members if m.pinned or m.spill
                    or m.mix_cards}
            if len(pins) > 1:
                raise ValueError(f"on-demand group {name}: its models share the same cards, so give gpus, board, spill "
                                 f"and mix_cards on one of them or the same on each")
            ids = [m.id for m in members]
            if len(set(ids)) != len(ids):
                raise ValueError(f"on-demand group {name} names {sorted({i for i in ids if ids.count(i) > 1})[0]} "
                                 f"twice; a group serves each model once")
        return self

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
    def _power_limits_on_linux(self) -> Box:
        if self.power_limit_w is not None and self.os == "windows":
            raise ValueError("power_limit_w: power limits are applied by a Linux boot unit; remove it from this "
                             "Windows box")
        if self.power_limit_w == {}:
            self.power_limit_w = None
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
    def effective_model_dir(self) -> str:
        if self.model_dir:
            return self.model_dir.replace("/", "\\") if self.os == "windows" else self.model_dir
        return DEFAULT_MODEL_DIR[self.os]

    @property
    def binds_beyond_loopback(self) -> bool:
        return not ipaddress.ip_address(self.bind).is_loopback


ACCOUNT_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"


class Workstation(Connection):
    """A machine whose accounts get the agent clients wired to boxes of the fleet (roles/agent_clients).

    Reached like a box (the same connection fields); the boxes' API keys come from the controller, so every
    box it names needs ``api_key`` in the fleet file.
    """

    boxes: list[str] = Field(min_length=1)  # the boxes whose services its accounts use
    accounts: list[str] = Field(default_factory=list)  # accounts to wire; empty: the account the controller logs in as
    openclaw: bool = True  # merge the services into each account's OpenClaw config (Linux)

    @field_validator("accounts")
    @classmethod
    def _account_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not re.match(ACCOUNT_PATTERN, name):
                raise ValueError(f"account {name!r}: give an account name (letters, digits, '.', '-', '_')")
        return list(dict.fromkeys(value))

    @property
    def wired_accounts(self) -> list[str]:
        return self.accounts or [self.user]


class Fleet(_Strict):
    boxes: dict[str, Box]
    # Machines whose accounts use the boxes' services: launch scripts and the OpenClaw config, written by
    # `controller provision <workstation>` (playbooks/clients.yml).
    workstations: dict[str, Workstation] = Field(default_factory=dict)
    catalogs: list[Path] = Field(default_factory=list)  # extra model catalogs, merged over the built-in one
    # Named sets of boxes (`groups: {rack1: [box1, box2]}`): `controller provision rack1` runs them all;
    # hosts.yml carries each as an Ansible group of the same name (`--limit rack1`).
    groups: dict[str, list[str]] = Field(default_factory=dict)
    source: Path | None = Field(default=None, exclude=True)
    cache: LanCache | None = None  # a model and engine-pack cache on the LAN, used by every box

    @model_validator(mode="after")
    def _cache_on_a_box(self) -> Fleet:
        cache = self.cache
        if cache is None:
            return self
        host = self.boxes.get(cache.host)
        if host is None:
            raise ValueError(f"cache.host names {cache.host!r}, which is not a box of this fleet (boxes: "
                             f"{', '.join(sorted(self.boxes)) or 'none'}); for the controller host, add it as a box "
                             f"with transport: local")
        if host.os != "linux":
            raise ValueError(f"cache.host {cache.host!r} is a Windows box: the cache (nginx) runs on a Linux box")
        if not (cache.models or cache.engines):
            raise ValueError("cache: give the upstream it fills from: models (a hub or mirror base URL), engines "
                             "(the release packs' folder), or both")
        others = [box for box in self.boxes.values() if box.name != cache.host and box.transport != "local"]
        if host.transport == "local" and not cache.address and others:
            raise ValueError(f"cache.address: the cache host {cache.host!r} is the controller (transport: local); give "
                             "the address the other boxes reach it at")
        address = cache.address or ("127.0.0.1" if host.transport == "local" else host.address)
        if not cache.allow_from and not ipaddress.ip_address(cache.bind).is_loopback:
            hostnames = [name for name, box in sorted(self.boxes.items()) if _ip(box.address) is None]
            if hostnames:
                raise ValueError(f"cache.allow_from: boxes {', '.join(hostnames)} are named by host name; list the "
                                 f"networks that may fetch from the cache (e.g. [192.168.1.0/24])")
        for name, box in self.boxes.items():
            for kind in ("models", "engines"):
                if getattr(cache, kind) and getattr(box.mirror, kind):
                    raise ValueError(f"box {name!r}: mirror.{kind} and the fleet's cache.{kind} both say where "
                                     f"{kind} come from; remove mirror.{kind} (the cache fills from cache.{kind})")
            url_host = f"[{address}]" if ":" in address else address
            serve = CacheServer(bind=cache.bind, port=cache.port, allow_from=self.cache_allow_from())
            box.mirror._cache = CacheRoute(host=cache.host, url=f"http://{url_host}:{cache.port}",
                                           fallback=cache.fallback, models=cache.models, engines=cache.engines,
                                           serve=serve if name == cache.host else None)
        return self

    def cache_allow_from(self) -> list[str]:
        """The networks the cache serves: the fleet's cache.allow_from, else every box's address."""
        if self.cache is None:
            return []
        if self.cache.allow_from:
            return self.cache.allow_from
        found = {_ip(box.address) for box in self.boxes.values()} | {"127.0.0.0/8"}
        return sorted(str(ipaddress.ip_network(item)) for item in found if item is not None)

    @model_validator(mode="after")
    def _groups_name_boxes(self) -> Fleet:
        for group, members in self.groups.items():
            if not re.match(BOX_NAME_PATTERN, group) or group in RESERVED_GROUPS:
                raise ValueError(f"group {group!r}: use lowercase letters, digits, '-' and '_' (not "
                                 f"{', '.join(sorted(RESERVED_GROUPS))}, which the inventory uses)")
            if group in self.boxes:
                raise ValueError(f"group {group!r} has the name of a box: rename the group")
            unknown = [name for name in members if name not in self.boxes]
            if unknown or not members:
                raise ValueError(f"group {group!r} names {', '.join(map(repr, unknown)) or 'no box'}, "
                                 f"not a box of this fleet (boxes: {', '.join(sorted(self.boxes))})")
        return self

    def shared_address(self) -> str | None:
        """One line naming two boxes reached at the same address and port (None: every box has its own)."""
        seen: dict[tuple[str, int], str] = {}
        for name in sorted(self.boxes):
            box = self.boxes[name]
            if box.transport == "local":
                continue
            where = (_canonical_address(box.address), box.effective_port)
            if where in seen:
                return (f"boxes {seen[where]!r} and {name!r} share the address {box.address}:{box.effective_port}; "
                        f"give each box its own address (or port): they would be provisioned as one machine")
            seen[where] = name
        return None

    def select(self, names: Collection[str], everything: bool = False) -> list[str]:
        """The boxes a command runs on: box names and group names (in the order given), or every box."""
        if everything and names:
            raise FleetError(f"name boxes or groups, or give --all, not both (got --all and {' '.join(names)})")
        if everything:
            return sorted(self.boxes)
        if not names:
            raise FleetError("name a box or a group of the fleet, or give --all")
        chosen: list[str] = []
        for name in names:
            if name in self.boxes:
                chosen.append(name)
            elif name in self.groups:
                chosen.extend(self.groups[name])
            else:
                groups = f"; groups: {', '.join(sorted(self.groups))}" if self.groups else ""
                raise FleetError(f"{self.source or 'fleet'}: no box or group named {name!r} (boxes: "
                                 f"{', '.join(sorted(self.boxes)) or 'none'}{groups})")
        return list(dict.fromkeys(chosen))

    @model_validator(mode="after")
    def _gateway_boxes_exist(self) -> Fleet:
        for box in self.boxes.values():
            for other in box.gateway.boxes if box.gateway else []:
                if other not in self.boxes:
                    known = ", ".join(sorted(self.boxes))
                    raise ValueError(f"box {box.name!r}: gateway.boxes names {other!r}, which is not a box of this "
                                     f"fleet (boxes: {known})")
        return self

    @model_validator(mode="after")
    def _workstations_reach_their_boxes(self) -> Fleet:
        seen = {(_canonical_address(box.address), box.effective_port): f"box {name!r}"
                for name, box in sorted(self.boxes.items()) if box.transport != "local"}
        for name, station in sorted(self.workstations.items()):
            if name in self.boxes or name in self.groups:
                raise ValueError(f"workstation {name!r} has the name of a box or group: rename the workstation")
            where = (_canonical_address(station.address), station.effective_port)
            if station.transport != "local" and where in seen:
                raise ValueError(f"workstation {name!r} and {seen[where]} share the address {station.address}:"
                                 f"{station.effective_port}; they would be one machine: give each its own address "
                                 f"(a box wires its own accounts itself)")
            seen[where] = f"workstation {name!r}"
            for box_name in station.boxes:
                box = self.boxes.get(box_name)
                if box is None:
                    raise ValueError(f"workstation {name!r}: boxes names {box_name!r}, which is not a box of this "
                                     f"fleet (boxes: {', '.join(sorted(self.boxes)) or 'none'})")
                if box.api_key is None:
                    raise ValueError(f"workstation {name!r}: box {box_name!r} has no api_key in the fleet file, so its "
                                     f"key exists only on the box; set api_key (env: or file:) for that box")
                problem = _unreachable_from(box, station)
                if problem:
                    raise ValueError(f"workstation {name!r}: box {box_name!r} {problem}")
        return self

    def workstation(self, name: str) -> Workstation:
        try:
            return self.workstations[name]
        except KeyError:
            known = ", ".join(sorted(self.workstations)) or "none"
            raise FleetError(f"{self.source or 'fleet'}: no workstation named {name!r} (workstations: {known})") from None

    def box(self, name: str) -> Box:
        try:
            return self.boxes[name]
        except KeyError:
            known = ", ".join(sorted(self.boxes)) or "none"
            raise FleetError(f"{self.source or 'fleet'}: no box named {name!r} (boxes: {known})") from None

    def check_models_known(self, box: Box, known: Collection[str]) -> None:
        """Refuse a model id the catalog lacks; called before any connection to the box."""
        for wanted in box.models:
            for model_id, what in ((wanted.id, "model"), (wanted.draft, "draft model")):
                if model_id is not None and model_id != "auto" and model_id not in known:
                    raise FleetError(f"{self.source or 'fleet'}: box {box.name!r}: unknown {what} id {model_id!r}; "
                                     f"the catalog has: {', '.join(sorted(known))}")


def _unreachable_from(box: Box, station: Workstation) -> str | None:
    """Why the box's servers cannot be reached from the workstation (None: they can, as far as the fleet says)."""
    if not box.binds_beyond_loopback:
        if _canonical_address(box.address) == _canonical_address(station.address):
            return None  # one network stack (the same host, or containers sharing one): loopback reaches it
        return (f"binds {box.bind}, which only the box itself reaches; bind it beyond loopback (bind, with "
                f"allow_from naming the workstation's network)")
    try:
        address = ipaddress.ip_address(_canonical_address(station.address))
    except ValueError:
        return None  # a host name: the firewall's networks cannot be checked here
    if address.is_loopback or any(address in ipaddress.ip_network(net) for net in box.allow_from):
        return None
    return (f"accepts connections only from {', '.join(box.allow_from)} (allow_from), not from {station.address}; "
            f"add the workstation's network to that box's allow_from")


def _canonical_address(address: str) -> str:
    """An address as one spelling: IP addresses normalised, host names lowercased, localhost as 127.0.0.1."""
    text = address.strip().lower().rstrip(".")
    if text == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        return text


def _ip(address: str) -> str | None:
    """The address as an IP address (None: a host name)."""
    try:
        return str(ipaddress.ip_address(_canonical_address(address)))
    except ValueError:
        return None


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
    stations = raw.get("workstations")
    if isinstance(stations, dict):  # the defaults that say how to connect apply to workstations too
        reach = {key: value for key, value in defaults.items() if key in Connection.model_fields and key != "name"}
        raw["workstations"] = {
            name: {**reach, **(body or {}), "name": name} if isinstance(body, dict) or body is None else body
            for name, body in stations.items()
        }
    return raw


def _describe(error: ValidationError, source: Path) -> str:
    lines = []
    for item in error.errors():
        loc = list(item["loc"])
        where = ""
        if len(loc) >= 2 and loc[0] in ("boxes", "workstations"):
            where = f"{'box' if loc[0] == 'boxes' else 'workstation'} {loc[1]!r}, "
            loc = loc[2:]
        field = ".".join(str(part) for part in loc) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field (check the spelling; see the fleet file reference in README.md)"
        if not loc and not where and item["type"] == "value_error":  # a check across boxes: its own sentence
            lines.append(f"{source}: {message}")
            continue
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
    shared = fleet.shared_address()
    if shared:
        raise FleetError(f"{source}: {shared}")
    fleet.catalogs = [path if path.is_absolute() else base / path for path in fleet.catalogs]
    for box in [*fleet.boxes.values(), *fleet.workstations.values()]:
        if box.key is not None and not box.key.is_absolute() and not str(box.key).startswith("~"):
            box.key = base / box.key
    return fleet


def load_fleet(path: Path) -> Fleet:
    text = read_text(path, "fleet file", FleetError, FLEET_MAX_BYTES)
    return parse_fleet(load_yaml(text, path, FleetError), path)
