"""Read llama.cpp / ik_llama.cpp load logs: the model's metadata and the buffers the engine allocated.

Two uses: the accuracy benchmark compares the estimator with the buffer sizes a real server
reports at ``-lv 4``, and the public load logs in the shared fixtures are turned back into
header-only GGUFs (their metadata dump plus the per-layer values from the ``print_info`` block) so
the estimator can be checked against engines and machines this project cannot run. The parser
tolerates the variants found in the wild: ``print_info:`` vs ``llm_load_print_meta:``, CRLF line
ends, alignment spaces collapsed by a paste, and remarks appended to a line.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

_KV_DUMP = re.compile(r"llama_model_loader: - kv\s+\d+:\s+(\S+)\s+(\S+)\s+=\s?(.*)$")
_ARRAY_TYPE = re.compile(r"arr\[(\w+),(\d+)\]")
_META = re.compile(r"^(?:print_info|llm_load_print_meta):\s+(\w+)\s+=\s+(.*)$")
_CONTEXT = re.compile(r"^(?:llama_context|llama_new_context_with_model):\s+(\w+)\s+=\s+(\S+)")
_BUFFER = re.compile(r"^(\w+):\s+(\S+) (KV|model|compute|RS) buffer size\s*=\s*([\d.]+) MiB")
_KV_SELF = re.compile(r"KV self size\s*=\s*([\d.]+) MiB, K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB")
_KV_SELF_TOTAL = re.compile(r"KV self size\s*=\s*([\d.]+) MiB")
_KV_SIZE = re.compile(
    r"^(llama_kv_cache\w*): size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)(?:/(\d+))? seqs\), "
    r"K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB"
)
_KV_INIT_TYPES = re.compile(r"type_k = '(\w+)', type_v = '(\w+)'")
_CACHE_TYPE_IN_KV_SELF = re.compile(r"c\^KV \((\w+)\):\s*([\d.]+) MiB")

# newer servers prefix each line with "[pid] " and/or "h.mm.ss.mmm L " (time and level)
_PREFIX = re.compile(r"^\s*(?:\[\d+\]\s+)?(?:\d+\.\d+\.\d+\.\d+\s+[IWEDT]\s+)?")
_SCALARS = {"u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64"}


@dataclass
class LoadLog:
    """What one load log says about the model, the context settings and the allocated buffers."""

    metadata: dict[str, Any] = field(default_factory=dict)
    array_lengths: dict[str, int] = field(default_factory=dict)
    meta: dict[str, str] = field(default_factory=dict)
    context: dict[str, str] = field(default_factory=dict)
    buffers: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    kv_self_mib: float | None = None
    type_k: str | None = None
    type_v: str | None = None
    kv_cells: list[int] = field(default_factory=list)
    kv_streams: list[int] = field(default_factory=list)

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture") or self.meta.get("arch", ""))

    @property
    def is_ik(self) -> bool:
        """ik_llama.cpp logs use the pre-2025 names and print mla_attn/attn_max_b context fields."""
        return "mla_attn" in self.context or "attn_max_b" in self.context

    def total(self, kind: str) -> float:
        return sum(self.buffers.get(kind, {}).values())

    def meta_list(self, name: str) -> list[int] | None:
        """A print_info value that is a per-layer list (``[8, 8, 0, ...]``), when printed in full."""
        raw = self.meta.get(name, "")
        if not raw.startswith("[") or not raw.rstrip().endswith("]"):
            return None
        return [int(v) for v in raw.strip("[] ").split(",") if v.strip()]


def _value(vtype: str, raw: str) -> Any:
    raw = raw.strip()
    if vtype in _SCALARS:
        return int(raw)
    if vtype in ("f32", "f64"):
        return float(raw)
    if vtype == "bool":
        return raw == "true"
    return raw


def _array(item_type: str, raw: str) -> list[Any] | None:
    raw = raw.strip()
    if not raw.endswith("]") or raw.endswith("...]"):
        return None  # truncated in the log: only the length is known
    items = [item.strip() for item in raw.strip("[]").split(",") if item.strip()]
    if item_type in _SCALARS:
        return [int(v) for v in items]
    if item_type in ("f32", "f64"):
        return [float(v) for v in items]
    if item_type == "bool":
        return [v == "true" for v in items]
    return None


def parse_log(text: str) -> LoadLog:
    """Parse a load log; unknown lines are ignored, repeated buffer lines for one device are summed."""
    log = LoadLog()
    for line in text.replace("\r", "").splitlines():
        line = _PREFIX.sub("", re.sub(r"\x1b\[[0-9;]*m", "", line)).strip()
        if match := _KV_DUMP.search(line):
            key, vtype, raw = match.groups()
            if array := _ARRAY_TYPE.fullmatch(vtype):
                log.array_lengths[key] = int(array.group(2))
                values = _array(array.group(1), raw)
                if values is not None:
                    log.metadata[key] = values
            else:
                log.metadata[key] = _value(vtype, raw)
            continue
        if match := _META.match(line):
            log.meta.setdefault(match.group(1), match.group(2).strip())
            continue
        if match := _CONTEXT.match(line):
            log.context[match.group(1)] = match.group(2)
            continue
        if match := _BUFFER.match(line):
            _source, device, kind, mib = match.groups()
            # several caches (iSWA base + SWA, hybrid attention + state) each print their own line
            log.buffers[kind][device] = log.buffers[kind].get(device, 0.0) + float(mib)
            continue
        if match := _KV_SELF_TOTAL.search(line):
            log.kv_self_mib = float(match.group(1))
            if types := _KV_SELF.search(line):
                log.type_k, log.type_v = types.group(2), types.group(4)
            elif mla := _CACHE_TYPE_IN_KV_SELF.search(line):
                log.type_k = mla.group(1)
            continue
        if match := _KV_SIZE.match(line):
            log.kv_cells.append(int(match.group(3)))
            log.kv_streams.append(int(match.group(6) or 1))
            log.type_k, log.type_v = match.group(7), match.group(9)
            continue
        if match := _KV_INIT_TYPES.search(line):
            log.type_k, log.type_v = match.groups()
    return log


# print_info names of per-layer values, and the GGUF key each one stands for
_PER_LAYER_META = {"n_head": "attention.head_count", "n_head_kv": "attention.head_count_kv", "n_ff": "feed_forward_length"}
# print_info scalars that fill keys an older dump may lack
_SCALAR_META = {"n_swa": "attention.sliding_window", "n_swa_pattern": "attention.sliding_window_pattern",
                "n_ctx_train": "context_length", "n_embd": "embedding_length", "n_layer": "block_count",
                "n_expert": "expert_count", "n_expert_used": "expert_used_count",
                "n_embd_head_k": "attention.key_length", "n_embd_head_v": "attention.value_length",
                "n_lora_kv": "attention.kv_lora_rank", "n_rot": "rope.dimension_count"}


def header_metadata(log: LoadLog) -> dict[str, Any]:
    """GGUF metadata that describes the logged model: the dumped keys, completed from ``print_info``.

    Dumped arrays the log truncated (per-layer head counts, the vocabulary) are rebuilt from the
    print_info lists or replaced by their length (``<arch>.vocab_size``); tokenizer and quantizer
    bookkeeping is left out because no memory rule depends on it.
    """
    arch = log.arch
    metadata: dict[str, Any] = {}
    for key, value in log.metadata.items():
        if key.startswith(("tokenizer.", "quantize.", "split.")) or key == "general.architecture":
            continue
        if isinstance(value, str) and value.endswith("..."):
            continue
        metadata[key] = value
    for name, suffix in _PER_LAYER_META.items():
        key = f"{arch}.{suffix}"
        values = log.meta_list(name)
        if values is not None and not isinstance(metadata.get(key), (int, list)):
            metadata[key] = values
        elif values is None and key not in metadata and log.meta.get(name, "").isdigit():
            metadata[key] = int(log.meta[name])
    for name, suffix in _SCALAR_META.items():
        key = f"{arch}.{suffix}"
        raw = log.meta.get(name, "")
        if key not in metadata and raw.isdigit() and (suffix != "attention.sliding_window" or int(raw) > 0):
            metadata[key] = int(raw)
    tokens = log.array_lengths.get("tokenizer.ggml.tokens")
    if tokens or log.meta.get("n_vocab", "").isdigit():
        metadata.setdefault(f"{arch}.vocab_size", tokens or int(log.meta["n_vocab"]))
    return metadata


def context_settings(log: LoadLog) -> dict[str, Any]:
    """The server settings the log shows, as ``resolve_settings`` keyword arguments.

    Logs from before per-sequence KV streams (no ``kv_unified`` line) had one cache shared by all
    sequences, which is what ``kv_unified=True`` models.
    """
    ctx = log.context.get("n_ctx")
    fa = log.context.get("flash_attn", "auto")
    unified = log.context.get("kv_unified")
    settings: dict[str, Any] = {
        "engine": "ik" if log.is_ik else "upstream",
        "ctx": int(ctx) if ctx and ctx.isdigit() else None,
        "parallel": int(log.context.get("n_seq_max", "1") or 1),
        "kv_unified": True if unified is None else unified == "true",
        "flash_attn": {"1": "on", "0": "off", "true": "on", "false": "off", "enabled": "on"}.get(fa, "auto"),
        "cache_type_k": log.type_k or "f16",
        "cache_type_v": log.type_v or log.type_k or "f16",
    }
    if log.context.get("n_ubatch", "").isdigit():
        settings["ubatch"] = int(log.context["n_ubatch"])
    return settings
