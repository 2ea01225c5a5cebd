"""Model and engine catalogs: the built-in YAML files, with user catalogs merged over them."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from controller.errors import CatalogError
from controller.model.inputs import CATALOG_MAX_BYTES, MAX_GPU_INDEX, MAX_LAYERS, load_yaml, read_text
from controller.model.rules import NEWEST_KNOWN_ARCH, VOLTA_ARCH

# A GGUF metadata value as the catalog writes it: a number, a flag, or one value per layer.
HParam = int | float | bool | list[int] | list[bool]

# Ids, engine slots and file names become folder and file names on the boxes and command-line words
# of the servers: one plain word each, never a path (no separators, no "..") and never a template.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_FIRST_ARCH = 30  # sm_30, the oldest architecture CMake names


def _name(value: str) -> str:
    if not _NAME.fullmatch(value) or ".." in value:
        raise ValueError(f"{value!r} is not a plain name: use letters, digits and . _ + - only (no path separators, "
                         "no '..', no spaces), starting with a letter or digit")
    return value


def _repo(value: str) -> str:
    parts = value.split("/")
    if len(parts) > 2 or not all(_NAME.fullmatch(part) and ".." not in part for part in parts):
        raise ValueError(f"{value!r} is not a hub repository: give 'owner/name' (letters, digits, . _ + -)")
    return value


def _one_line(value: str) -> str:
    if _CONTROL.search(value):
        raise ValueError(f"{value!r} holds a newline or control character; write it on one line")
    return value


def _address(value: str) -> str:
    if _CONTROL.search(value) or " " in value or not value.startswith(("http://", "https://")):
        raise ValueError(f"{value!r} is not an http(s) address (no spaces or control characters)")
    return value


# GGUF stores counts and sizes as unsigned 32-bit integers; a larger one is a typo, never a model.
HPARAM_MAX = 2**32 - 1
# Keys that must be a positive whole number (per layer: positive on some layer): a model without layers, heads,
# vocabulary or a KV width would "fit" anywhere.
_POSITIVE_COUNTS = frozenset({"block_count", "embedding_length", "vocab_size", "context_length", "attention.head_count",
                              "attention.head_count_kv", "attention.key_length", "attention.value_length"})
# Keys that must be a positive number (a scale or a base, never zero).
_POSITIVE_SCALES = frozenset({"rope.freq_base"})
# Keys that count or size something are whole numbers (scales, bases and epsilons are the ones that are not).
_WHOLE = re.compile(r"length|count|size|rank|kernel|interval|window|layers")


def _hparam_problem(key: str, value: object) -> str | None:
    """Why one ``hparams`` value cannot describe a model, or None."""
    positive = key in _POSITIVE_COUNTS
    whole = positive or bool(_WHOLE.search(key))
    if isinstance(value, list):
        if not value or len(value) > MAX_LAYERS:
            return f"give one value per layer (1 to {MAX_LAYERS} values; llama.cpp loads at most {MAX_LAYERS} layers)"
        if positive and not any(item for item in value if not isinstance(item, bool)):
            return "every layer has 0; at least one layer needs a positive number"
        for item in value:
            if not isinstance(item, bool) and (problem := _number_problem(item, whole=whole, positive=False)):
                return problem
        return None
    if isinstance(value, bool):
        return "true/false where a number belongs" if positive or key in _POSITIVE_SCALES else None
    if key == "block_count" and isinstance(value, int) and value > MAX_LAYERS:
        return f"{value} layers; llama.cpp loads at most {MAX_LAYERS}"
    return _number_problem(value, whole=whole, positive=positive or key in _POSITIVE_SCALES)


def _number_problem(value: object, *, whole: bool, positive: bool) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} is not a number a model has; give the figure from the model's config"
    if whole and not isinstance(value, int):
        return f"{value!r} is not a whole number; give the count from the model's config"
    if value < 0 or (positive and value == 0):
        least = "a positive number" if positive else "0 or more"
        return f"{_shown(value)} is {'negative' if value < 0 else 'zero'}; give the figure from the model's config " \
               f"({least})"
    if value > HPARAM_MAX:
        return f"{_shown(value)} is beyond any model (GGUF stores at most {HPARAM_MAX})"
    return None


def _shown(value: object) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"a {len(text)}-digit number"


def _hparams(value: dict[str, HParam]) -> dict[str, HParam]:
    for key, item in value.items():
        if problem := _hparam_problem(key, item):
            raise ValueError(f"{key}: {problem}")
    for part, whole in (("nextn_predict_layers", "block_count"), ("leading_dense_block_count", "block_count"),
                        ("expert_used_count", "expert_count"), ("attention.head_count_kv", "attention.head_count")):
        small, large = value.get(part), value.get(whole)
        if isinstance(small, int) and isinstance(large, int) and small > large - (part == "nextn_predict_layers"):
            least = "below" if part == "nextn_predict_layers" else "at most"
            raise ValueError(f"{part} {small} must be {least} {whole} {large}; give the figures from the model's config")
    return value


Name = Annotated[str, AfterValidator(_name)]
OneLine = Annotated[str, AfterValidator(_one_line)]
Address = Annotated[str, AfterValidator(_address)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizerFacts(_Strict):
    """The vocabulary facts llama.cpp compares before it drafts with a second model, transcribed from a GGUF's
    ``tokenizer.ggml.*`` keys (``model``, ``pre``, the token count, BOS/EOS ids and whether they are added).

    ``controller.stages.planner.draft`` compares two entries' facts when their GGUF headers are not read; with
    the headers it compares the token texts themselves, as the engine does."""

    model: Name  # tokenizer.ggml.model: gpt2 (BPE), llama (SentencePiece), ...
    pre: Name | None = None  # tokenizer.ggml.pre: the pre-tokenizer, a stand-in for the token texts
    tokens: int = Field(ge=1, le=HPARAM_MAX)  # len(tokenizer.ggml.tokens)
    bos: int | None = Field(default=None, ge=0, le=HPARAM_MAX)
    eos: int | None = Field(default=None, ge=0, le=HPARAM_MAX)
    add_bos: bool = False
    add_eos: bool = False


class DraftPairing(_Strict):
    """A draft model the catalog recommends for a target, with the speedup it is expected to give and
    where that figure comes from."""

    id: Name  # the draft's catalog id
    speedup: OneLine  # e.g. "~55 -> ~100 tok/s (1.8x)"
    source: OneLine  # where the figure was measured


Rate = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class ThroughputBand(_Strict):
    """What a model is expected to do on some hardware: ``controller certify`` fails a service whose measured
    rate is below the band's minimum. A band applies to a service on ``gpus`` cards (0: the CPU), with or
    without experts offloaded to the CPU, split across cards or not, on the named driver model (None: a native
    Linux or TCC box); the first band that matches is used. ``source`` says where the figures come from."""

    hardware: OneLine  # what a person reads, e.g. "one V100 32 GB, native Windows (TCC)"
    gpus: int = Field(ge=0, le=MAX_GPU_INDEX + 1)
    offload: bool = False  # experts offloaded to CPU RAM (the service's cpu_offload)
    split: Literal["none", "layer", "tensor"] = "none"
    driver_model: Literal["TCC", "MCDM", "WDDM"] | None = None
    reference_gen_tok_s: Rate | None = None  # the measured figure the band is built around
    gen_tok_s: tuple[Rate, Rate | None]  # minimum (below it the check fails) and maximum (None: no maximum)
    prompt_tok_s: tuple[Rate, Rate | None] | None = None
    source: OneLine

    @model_validator(mode="after")
    def _minimum_below_maximum(self) -> ThroughputBand:
        for name in ("gen_tok_s", "prompt_tok_s"):
            low, high = getattr(self, name) or (0, None)
            if high is not None and high < low:
                raise ValueError(f"{name}: the minimum {low} is above the maximum {high}; give [minimum, maximum]")
        return self


class ModelEntry(_Strict):
    id: Name
    name: OneLine
    repo: Annotated[str, AfterValidator(_repo)]
    file: Name  # a file name in the model folder, never a path
    size_bytes: int | None = Field(default=None, ge=0, le=2**50)  # the GGUF's bytes; 1 PiB is beyond any model
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    engine: Name  # engine family ("upstream", "ik") or an exact engine id
    moe: bool = False
    mtp: bool = False
    sliding_window: bool = False
    # A chat template file shipped in roles/llama_service/files/chat-templates: a name, so it can
    # never reach a file outside that folder.
    template: Name | None = None
    hub_url: Address | None = None  # where <repo>/resolve/main/<file> lives; defaults to the catalog's
    # What the planner needs to estimate memory without downloading the model. ``arch`` and
    # ``hparams`` are the GGUF's general.architecture and its ``<arch>.*`` keys (without the
    # prefix), taken from the model's published config; ``file_type`` names the quantisation the
    # file uses. Entries whose shape is not published carry the kit's measured figures instead
    # (``measured: true`` with ``kv_bytes_per_token`` per cache type and ``size_bytes``).
    arch: str | None = None
    file_type: str | None = None
    hparams: Annotated[dict[str, HParam], AfterValidator(_hparams)] = Field(default_factory=dict)
    tied_embeddings: bool = False  # the output layer reuses token_embd (no output.weight in the GGUF)
    measured: bool = False
    kv_bytes_per_token: dict[str, Annotated[int, Field(ge=1, le=HPARAM_MAX)]] = Field(default_factory=dict)
    tokenizer: TokenizerFacts | None = None  # what a draft pairing compares when no GGUF header is read
    drafts: list[DraftPairing] = Field(default_factory=list)  # recommended draft models, best first
    throughput: list[ThroughputBand] = Field(default_factory=list)  # expected rates, first match wins
    # The model's chat template makes tool calls (Claude Code and OpenClaw need them); certify's tool-call round
    # trip is checked only then. False for a model that cannot, such as the lab's tiny random models.
    tool_calls: bool = True

    @model_validator(mode="after")
    def _shape_is_complete(self) -> ModelEntry:
        if self.hparams and not self.arch:
            raise ValueError("hparams need 'arch' (the GGUF general.architecture, e.g. qwen35moe)")
        if self.measured and not (self.size_bytes and self.kv_bytes_per_token):
            raise ValueError("a measured entry needs size_bytes and kv_bytes_per_token (bytes per cache type)")
        return self

    @property
    def dense(self) -> bool:
        """Every weight is used for every token (no routed experts): split such models by tensor."""
        return not self.moe

    def url(self, mirror: str | None = None) -> str:
        base = (mirror or self.hub_url or "").rstrip("/")
        if not base:
            raise CatalogError(f"model {self.id}: no download address; set mirror.models in the fleet file")
        return f"{base}/{self.repo}/resolve/main/{self.file}"


class EnginePack(_Strict):
    file: Name
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class EngineApiKey(_Strict):
    """How an engine version reads its API key. The role passes a key file (``file_flag``), read through
    systemd credentials, never the key itself on the command line; ``env`` only records the variable the
    version also reads (ik_llama.cpp reads none), so nothing relies on it."""

    file_flag: OneLine = "--api-key-file"  # one key per line; the whole line is the key
    env: OneLine | None = None


class EngineRouter(_Strict):
    """How an engine version serves several models behind one port (llama-server's router mode: started without
    ``--model``, each model a child llama-server on a loopback port, loaded on request, least recently used
    unloaded first). ``key_file_env`` is the variable the router and its children read the key file's path from:
    a key given as a flag would reach the router only and leave every child's port open."""

    preset: OneLine = "--models-preset"  # an INI file: one section per model, its keys the long flag names
    max_loaded: OneLine = "--models-max"  # how many children may be loaded at once
    key_file_env: OneLine = "LLAMA_ARG_API_KEY_FILE"
    stop_timeout: OneLine = "stop-timeout"  # the preset key: seconds before a model server told to exit is killed


class EngineDraftFlags(_Strict):
    """How an engine version spells the draft-model options of speculative decoding. An engine without
    them in the catalog is never given a draft model. ``ctx`` is None where the version has no draft
    context flag (the draft then allocates the target's ``--ctx-size``)."""

    model: OneLine
    n_max: OneLine
    n_min: OneLine
    gpu_layers: OneLine
    device: OneLine
    cache_type_k: OneLine
    cache_type_v: OneLine
    ctx: OneLine | None = None
    enable: list[OneLine] = Field(default_factory=list)  # flags that turn drafting on besides naming the model


class EngineEntry(_Strict):
    id: Name
    family: Name
    commit: Name
    description: str = ""
    min_driver: int | None = Field(default=None, ge=1, le=9999)  # driver major versions (the number before the first dot)
    max_driver: int | None = Field(default=None, ge=1, le=9999)
    cpu_only: bool = False
    nccl: bool = False
    load_flags: dict[str, list[OneLine]] = Field(default_factory=dict)
    api_key: EngineApiKey = Field(default_factory=EngineApiKey)
    no_slots_flags: list[OneLine] = Field(default_factory=lambda: ["--no-slots"])  # turn off GET /slots
    draft: EngineDraftFlags | None = None  # the draft-model flags; None: the catalog gives this engine no draft
    router: EngineRouter | None = None  # router mode (on-demand models); None: one model per server
    packs: dict[str, EnginePack]
    # The CUDA architectures the build carries machine code for, as CMAKE_CUDA_ARCHITECTURES numbers:
    # [70] (the kit's packs, and the default for a GPU build), [70, 86] or "70;86" for a build for several.
    # A CPU-only build has none.
    cuda_archs: list[int] | None = None

    @field_validator("cuda_archs", mode="before")
    @classmethod
    def _known_archs(cls, value: object) -> object:
        if value is None:
            return None
        parts = value.split(";") if isinstance(value, str) else value if isinstance(value, list) else [value]
        archs = []
        for part in parts:
            text = str(part).strip()
            if isinstance(part, bool) or not text.isdigit() or not _FIRST_ARCH <= int(text) <= NEWEST_KNOWN_ARCH:
                raise ValueError(f"{text or repr(value)} is not a CUDA architecture: write CMake's numbers, e.g. "
                                 f"[{VOLTA_ARCH}] for the V100, [{VOLTA_ARCH}, 86] (or '{VOLTA_ARCH};86') for a build "
                                 f"that also runs on the RTX 30 series")
            archs.append(int(text))
        return sorted(set(archs))

    @model_validator(mode="after")
    def _driver_window(self) -> EngineEntry:
        if self.min_driver is not None and self.max_driver is not None and self.min_driver > self.max_driver:
            raise ValueError(f"min_driver {self.min_driver} is above max_driver {self.max_driver}; give the oldest "
                             "driver branch the build runs on as min_driver")
        return self

    @model_validator(mode="after")
    def _archs_of_the_build(self) -> EngineEntry:
        if self.cpu_only and self.cuda_archs:
            raise ValueError("a cpu_only build carries no CUDA code: drop cuda_archs or cpu_only")
        if not self.cpu_only and self.cuda_archs == []:
            raise ValueError(f"cuda_archs is empty: a GPU build names the architectures it carries, e.g. "
                             f"[{VOLTA_ARCH}]")
        if self.cuda_archs is None:
            self.cuda_archs = [] if self.cpu_only else [VOLTA_ARCH]
        return self

    @property
    def slot(self) -> str:
        """The install folder name shared by every version of this engine: "upstream", "ik", "cpu"."""
        return self.id.removesuffix(f"-{self.commit}")


class DownloadEntry(_Strict):
    """A file the Windows roles fetch besides engines and models: the driver installer, WinSW.

    Where it comes from for a box is resolved by the planner (controller.stages.planner.sources); rendering
    refuses it unpinned, because it runs with full rights."""

    id: Name
    version: Name
    file: Name
    url: Address | None = None  # the publisher's address; a fleet mirror (<base>/<file>) replaces it
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    description: str = ""


class Catalog(_Strict):
    models: dict[str, ModelEntry]
    engines: dict[str, EngineEntry]
    downloads: dict[str, DownloadEntry] = Field(default_factory=dict)

    def model(self, model_id: str) -> ModelEntry:
        return _lookup(self.models, "model", model_id)

    def engine(self, engine_id: str) -> EngineEntry:
        return _lookup(self.engines, "engine", engine_id)


def _lookup(table: dict, kind: str, entry_id: str):
    """One entry of a catalog table, or the error that lists what the catalog has."""
    try:
        return table[entry_id]
    except KeyError:
        known = ", ".join(sorted(table)) or "none"
        raise CatalogError(f"unknown {kind} id {entry_id!r}; the catalog has: {known}") from None


def _read(text: str, source: str) -> dict:
    data = load_yaml(text, source, CatalogError) or {}
    if not isinstance(data, dict):
        raise CatalogError(f"{source}: expected a mapping with 'models' and/or 'engines'")
    unknown = set(data) - {"hub_url", "models", "engines", "downloads"}
    if unknown:
        raise CatalogError(f"{source}: unknown top-level keys {sorted(unknown)}; expected hub_url, models, engines, "
                           "downloads")
    return data


def _entries(data: dict, key: str, source: str) -> dict[str, dict]:
    section = data.get(key) or {}
    if not isinstance(section, dict):
        raise CatalogError(f"{source}: '{key}' must be a mapping of id to entry")
    out = {}
    for entry_id, body in section.items():
        if not isinstance(body, dict):
            raise CatalogError(f"{source}: {key} entry {entry_id!r} must be a mapping")
        entry = {"id": str(entry_id), **body}
        if key == "models" and data.get("hub_url") and "hub_url" not in body:
            entry["hub_url"] = data["hub_url"]
        out[str(entry_id)] = entry
    return out


@cache
def _builtin_texts() -> tuple[str, str]:
    data = resources.files("controller") / "data"
    return (data / "models.yml").read_text(), (data / "engines.yml").read_text()


def load_catalog(extra: Iterable[Path] = ()) -> Catalog:
    """The built-in catalog with each extra catalog file merged over it, entry by entry."""
    models_text, engines_text = _builtin_texts()
    models = _entries(_read(models_text, "built-in models.yml"), "models", "built-in models.yml")
    builtin_engines = _read(engines_text, "built-in engines.yml")
    engines = _entries(builtin_engines, "engines", "built-in engines.yml")
    downloads = _entries(builtin_engines, "downloads", "built-in engines.yml")
    origin = {("models", key): "built-in models.yml" for key in models}
    origin |= {(section, key): "built-in engines.yml" for section in ("engines", "downloads")
               for key in (engines if section == "engines" else downloads)}
    for path in extra:
        data = _read(read_text(Path(path), "catalog", CatalogError, CATALOG_MAX_BYTES), str(path))
        models.update(_entries(data, "models", str(path)))
        engines.update(_entries(data, "engines", str(path)))
        for entry_id, body in _entries(data, "downloads", str(path)).items():  # a pin may name only sha256
            downloads[entry_id] = {**downloads.get(entry_id, {}), **body}
        for section in ("models", "engines", "downloads"):
            origin |= {(section, str(key)): str(path) for key in (data.get(section) or {})}
    try:
        return Catalog.model_validate({"models": models, "engines": engines, "downloads": downloads})
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(part) for part in first["loc"]]
        source = origin.get(tuple(loc[:2]), "catalog")
        message = first["msg"].removeprefix("Value error, ")
        raise CatalogError(f"{source}: entry {'.'.join(loc)}: {message}") from None


def resolve_catalog_model(model_id: str, extra: Iterable[Path] = ()) -> ModelEntry:
    return load_catalog(extra).model(model_id)
