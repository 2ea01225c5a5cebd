"""Generate small but real GGUF models that the CPU llama-server loads and serves.

Tests need a model the real engine accepts (so its load log, memory buffers and both chat APIs
can be checked) without downloading anything. The files written here are ordinary GGUFs: real
architecture metadata, a tiny GPT-2-style BPE vocabulary (the 256 byte tokens, some merges and
three ChatML control tokens), a chat template, and weights from a fixed-seed generator, so the
same arguments always give the same bytes. The text they produce is garbage; the protocol is real.
``write_scripted_model`` is the exception: its weights say what its chat template cues (the demo box's model: a
tool call where an agent client expects one, then an answer).

Scaling ``n_embd``/``n_layer``/``n_vocab`` up gives files of hundreds of MB for checking the
memory estimator against the server's own buffer sizes.
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    MODEL_TENSOR,
    TENSOR_NAMES,
    GGMLQuantizationType,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
    TokenType,
)
from gguf.quants import quantize

ARCHS = ("llama", "qwen3moe", "gemma3")

# Weight encodings the numpy quantisers in gguf-py can produce, with the GGUF file_type each implies.
FILE_TYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q5_1": (GGMLQuantizationType.Q5_1, LlamaFileType.MOSTLY_Q5_1),
    "q5_0": (GGMLQuantizationType.Q5_0, LlamaFileType.MOSTLY_Q5_0),
    "q4_1": (GGMLQuantizationType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
}

# ChatML, the shape most instruct GGUFs use; the control tokens below make it tokenise as specials.
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}"
    "{{ part['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_WEIGHT_STD = 0.02


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: GGUF name, numpy-order shape, and its on-disk encoding."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    kind: str = "weight"  # "weight" (random) or "norm" (ones)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.n_elements // block * type_size


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which byte-level BPE vocabularies use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _merge_pairs() -> Iterator[tuple[str, str]]:
    """Merges in rank order: space+letter first, then letter pairs, so ordinary text merges a bit."""
    space = bytes_to_unicode()[ord(" ")]
    letters = string.ascii_lowercase
    for letter in letters:
        yield space, letter
    yield from itertools.product(letters, letters)


def build_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """Return (tokens, token types, merges) for a byte-level BPE vocabulary of exactly n_vocab tokens.

    The last three ids are the ChatML control tokens; ids beyond the available merges are padded
    with unused placeholder tokens, as many released vocabularies are.
    """
    minimum = 256 + len(SPECIAL_TOKENS)
    if n_vocab < minimum:
        raise ValueError(f"n_vocab must be at least {minimum} (256 byte tokens + {len(SPECIAL_TOKENS)} specials)")
    tokens = list(bytes_to_unicode().values())
    types = [int(TokenType.NORMAL)] * 256
    merges: list[str] = []
    n_regular = n_vocab - len(SPECIAL_TOKENS)
    pairs = _merge_pairs()
    while len(tokens) < n_regular:
        pair = next(pairs, None)
        if pair is None:
            tokens.append(f"<|unused_{len(tokens)}|>")
            types.append(int(TokenType.UNUSED))
            continue
        merges.append(f"{pair[0]} {pair[1]}")
        tokens.append(pair[0] + pair[1])
        types.append(int(TokenType.NORMAL))
    tokens.extend(SPECIAL_TOKENS)
    types.extend([int(TokenType.CONTROL)] * len(SPECIAL_TOKENS))
    return tokens, types, merges


def _name(tensor: MODEL_TENSOR, layer: int | None = None, suffix: str = "weight") -> str:
    base = TENSOR_NAMES[tensor]
    return (base.format(bid=layer) if layer is not None else base) + f".{suffix}"


@dataclass(frozen=True)
class ModelShape:
    """Hyperparameters of a generated model; validated once, used by metadata and tensor layout."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    sliding_window: int
    swa_pattern: int
    tied_embeddings: bool


def _tensor_specs(shape: ModelShape, qtype: GGMLQuantizationType) -> list[TensorSpec]:
    """The tensors llama.cpp's loader requires for the architecture, in GGUF (numpy) shape order."""
    f32 = GGMLQuantizationType.F32
    e, hd, v = shape.n_embd, shape.head_dim, shape.n_vocab
    q_out, kv_out = shape.n_head * hd, shape.n_head_kv * hd
    specs = [TensorSpec(_name(MODEL_TENSOR.TOKEN_EMBD), (v, e), qtype)]
    for il in range(shape.n_layer):
        specs += [
            TensorSpec(_name(MODEL_TENSOR.ATTN_NORM, il), (e,), f32, "norm"),
            TensorSpec(_name(MODEL_TENSOR.ATTN_Q, il), (q_out, e), qtype),
            TensorSpec(_name(MODEL_TENSOR.ATTN_K, il), (kv_out, e), qtype),
            TensorSpec(_name(MODEL_TENSOR.ATTN_V, il), (kv_out, e), qtype),
            TensorSpec(_name(MODEL_TENSOR.ATTN_OUT, il), (e, q_out), qtype),
            TensorSpec(_name(MODEL_TENSOR.FFN_NORM, il), (e,), f32, "norm"),
        ]
        if shape.arch in ("qwen3moe", "gemma3"):
            specs += [
                TensorSpec(_name(MODEL_TENSOR.ATTN_Q_NORM, il), (hd,), f32, "norm"),
                TensorSpec(_name(MODEL_TENSOR.ATTN_K_NORM, il), (hd,), f32, "norm"),
            ]
        if shape.arch == "gemma3":
            specs += [
                TensorSpec(_name(MODEL_TENSOR.ATTN_POST_NORM, il), (e,), f32, "norm"),
                TensorSpec(_name(MODEL_TENSOR.FFN_POST_NORM, il), (e,), f32, "norm"),
            ]
        if shape.arch == "qwen3moe":
            x, f = shape.n_expert, shape.n_ff_exp
            specs += [
                # Routers stay f32 in released MoE GGUFs: they are tiny and precision-sensitive.
                TensorSpec(_name(MODEL_TENSOR.FFN_GATE_INP, il), (x, e), f32),
                TensorSpec(_name(MODEL_TENSOR.FFN_GATE_EXP, il), (x, f, e), qtype),
                TensorSpec(_name(MODEL_TENSOR.FFN_DOWN_EXP, il), (x, e, f), qtype),
                TensorSpec(_name(MODEL_TENSOR.FFN_UP_EXP, il), (x, f, e), qtype),
            ]
        else:
            specs += [
                TensorSpec(_name(MODEL_TENSOR.FFN_GATE, il), (shape.n_ff, e), qtype),
                TensorSpec(_name(MODEL_TENSOR.FFN_DOWN, il), (e, shape.n_ff), qtype),
                TensorSpec(_name(MODEL_TENSOR.FFN_UP, il), (shape.n_ff, e), qtype),
            ]
    specs.append(TensorSpec(_name(MODEL_TENSOR.OUTPUT_NORM), (e,), f32, "norm"))
    if not shape.tied_embeddings:
        specs.append(TensorSpec(_name(MODEL_TENSOR.OUTPUT), (v, e), qtype))
    return specs


def _check_shape(shape: ModelShape, qtype: GGMLQuantizationType) -> None:
    """Reject shapes the engine or the quantiser would refuse, with the reason, before writing."""
    if shape.arch not in ARCHS:
        raise ValueError(f"arch {shape.arch!r} is not one of {', '.join(ARCHS)}")
    if shape.n_head % shape.n_head_kv:
        raise ValueError(f"n_head ({shape.n_head}) must be a multiple of n_head_kv ({shape.n_head_kv})")
    if shape.arch == "qwen3moe" and not 0 < shape.n_expert_used <= shape.n_expert:
        raise ValueError("qwen3moe needs 0 < n_expert_used <= n_expert")
    if shape.arch == "llama" and shape.head_dim * shape.n_head != shape.n_embd:
        raise ValueError("llama needs head_dim * n_head == n_embd (its n_rot must equal the head size)")
    block = GGML_QUANT_SIZES[qtype][0]
    rows = {shape.n_embd, shape.head_dim * shape.n_head, shape.n_ff if shape.arch != "qwen3moe" else shape.n_ff_exp}
    if any(r % block for r in rows):
        raise ValueError(f"row lengths {sorted(rows)} must be multiples of {block} for {qtype.name} weights")


def _metadata(shape: ModelShape, file_type: LlamaFileType, name: str, chat_template: str | None) -> dict[str, Any]:
    """GGUF key/values for the model, keyed by full name; values typed by _add_kv."""
    a = shape.arch
    kv: dict[str, Any] = {
        "general.name": name,
        "general.file_type": int(file_type),
        "general.quantization_version": 2,
        f"{a}.context_length": shape.n_ctx_train,
        f"{a}.embedding_length": shape.n_embd,
        f"{a}.block_count": shape.n_layer,
        f"{a}.feed_forward_length": shape.n_ff,
        f"{a}.attention.head_count": shape.n_head,
        f"{a}.attention.head_count_kv": shape.n_head_kv,
        f"{a}.attention.key_length": shape.head_dim,
        f"{a}.attention.value_length": shape.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.rope.freq_base": 10000.0,
        f"{a}.rope.dimension_count": shape.head_dim,
        f"{a}.vocab_size": shape.n_vocab,
    }
    if a == "qwen3moe":
        kv[f"{a}.expert_count"] = shape.n_expert
        kv[f"{a}.expert_used_count"] = shape.n_expert_used
        kv[f"{a}.expert_feed_forward_length"] = shape.n_ff_exp
    if a == "gemma3" and shape.sliding_window > 0:
        kv[f"{a}.attention.sliding_window"] = shape.sliding_window
        kv[f"{a}.attention.sliding_window_pattern"] = shape.swa_pattern
    tokens, types, merges = build_vocab(shape.n_vocab)
    kv.update({
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.add_bos_token": False,
    })
    if chat_template is not None:
        kv["tokenizer.chat_template"] = chat_template
    return kv


def _add_kv(writer: GGUFWriter, key: str, value: Any) -> None:
    """Write one key with the GGUF type llama.cpp expects for it (u32 counts, f32 floats, i32 type ids)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        if value < 0:
            writer.add_int32(key, value)
        elif value >= 1 << 32:
            writer.add_uint64(key, value)
        else:
            writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, Sequence):
        if value and isinstance(value[0], bool):
            writer.add_key_value(key, list(value), GGUFValueType.ARRAY, GGUFValueType.BOOL)
        elif key == "tokenizer.ggml.token_type":
            writer.add_key_value(key, list(value), GGUFValueType.ARRAY, GGUFValueType.INT32)
        else:
            writer.add_array(key, value)
    else:
        raise TypeError(f"cannot write {key}={value!r} to GGUF")


def _tensor_data(spec: TensorSpec, seed: int, index: int, given: np.ndarray | None = None) -> np.ndarray:
    """Deterministic contents for one tensor: ``given`` (float32, encoded as the spec says), else ones for norms
    and small normals otherwise (seeded per tensor)."""
    if given is not None:
        values = np.asarray(given, dtype=np.float32).reshape(spec.shape)
    elif spec.kind == "norm":
        values = np.ones(spec.shape, dtype=np.float32)
    else:
        rng = np.random.default_rng([seed, index])
        values = rng.standard_normal(spec.shape, dtype=np.float32)
        values *= _WEIGHT_STD
    if spec.qtype == GGMLQuantizationType.F32:
        return values
    if spec.qtype == GGMLQuantizationType.F16:
        return values.astype(np.float16)
    return quantize(values, spec.qtype)


def write_gguf(
    path: str | Path,
    arch: str,
    metadata: Mapping[str, Any],
    tensors: Sequence[TensorSpec],
    *,
    header_only: bool = False,
    seed: int = 0,
    values: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """Write a GGUF from explicit metadata and tensor specs; with header_only, stop before tensor data.

    ``values`` gives some tensors' contents by name (float32, numpy shape order); the others are generated.

    Header-only files are what a remote Range read sees and what the estimator must handle; they
    also let tests describe real large models (from their published hyperparameters) in a few KB.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, arch)
    try:
        for key, value in metadata.items():
            _add_kv(writer, key, value)
        for spec in tensors:
            raw_dtype = None if spec.qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else spec.qtype
            dtype = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(spec.qtype, np.uint8)
            shape = spec.shape if raw_dtype is None else _byte_shape(spec)
            writer.add_tensor_info(spec.name, shape, np.dtype(dtype), spec.nbytes, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        if not header_only:
            for index, spec in enumerate(tensors):
                writer.write_tensor_data(_tensor_data(spec, seed, index, (values or {}).get(spec.name)))
        writer.flush()
    finally:
        writer.close()
    return path


def _byte_shape(spec: TensorSpec) -> tuple[int, ...]:
    block, type_size = GGML_QUANT_SIZES[spec.qtype]
    return (*spec.shape[:-1], spec.shape[-1] // block * type_size)


# A chat template whose tool calls have no start tag (``<function=NAME>{json}</function>`` right after the
# generation prompt): with tool_choice "any" the server's grammar then forces a tool call even from a random model,
# so the certification's tool-call round trip runs for real in the lab. Templates that open a call with a tag
# (Hermes' <tool_call>) let free text come first, which a random model never ends. The cost: with tools offered
# and tool_choice auto, the engine rejects a plain-text reply, so agent clients (which always send tools) are
# served the default template instead.
TOOL_CALL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}\n{{ tool | tojson }}\n{%- endfor %}\n"
    "Call a tool as <function=name>{json arguments}</function><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n{% if message.content %}{{ message.content }}"
    "{% endif %}{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "<function={{ tool_call.function.name }}>{{ tool_call.function.arguments | tojson }}</function>"
    "{%- endfor %}{% endif %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>tool\n{{ message.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_model(
    path: str | Path,
    arch: str = "llama",
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 300,
    n_ctx_train: int = 4096,
    head_dim: int | None = None,
    n_expert: int = 4,
    n_expert_used: int = 2,
    n_ff_exp: int | None = None,
    sliding_window: int = 128,
    swa_pattern: int = 2,
    tied_embeddings: bool = False,
    file_type: str = "f32",
    chat_template: str | None = DEFAULT_CHAT_TEMPLATE,
    name: str | None = None,
    seed: int = 0,
    header_only: bool = False,
    extra_metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write a tiny (or, scaled up, large) model the CPU llama-server loads; returns the path.

    ``arch`` is llama, qwen3moe (``n_expert``/``n_expert_used``/``n_ff_exp`` apply) or gemma3
    (``sliding_window`` > 0 makes every ``swa_pattern``-th layer full attention and the others
    sliding-window, as llama.cpp reads ``sliding_window_pattern``). ``file_type`` picks the
    encoding of the 2-D weights (norms stay f32, as converters write them). ``extra_metadata`` adds or
    replaces keys, e.g. ``{"tokenizer.ggml.add_bos_token": True}`` for a tokenizer that prepends BOS.
    """
    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type {file_type!r} is not one of {', '.join(FILE_TYPES)}")
    qtype, ftype = FILE_TYPES[file_type]
    shape = ModelShape(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
        n_vocab=n_vocab, n_ctx_train=n_ctx_train, head_dim=head_dim or n_embd // n_head,
        n_expert=n_expert if arch == "qwen3moe" else 0,
        n_expert_used=n_expert_used if arch == "qwen3moe" else 0,
        n_ff_exp=(n_ff_exp or n_ff // max(n_expert_used, 1)) if arch == "qwen3moe" else 0,
        sliding_window=sliding_window if arch == "gemma3" else 0,
        swa_pattern=swa_pattern, tied_embeddings=tied_embeddings,
    )
    _check_shape(shape, qtype)
    label = name or f"tiny-{arch}-{n_layer}x{n_embd}-{file_type}"
    metadata = _metadata(shape, ftype, label, chat_template) | dict(extra_metadata or {})
    return write_gguf(path, arch, metadata, _tensor_specs(shape, qtype), header_only=header_only, seed=seed)


# ---------------------------------------------------------------- a scripted model: the demo box's agent loop

# What the scripted demo model says. Its chat template ends the generation prompt with one of these trigger tokens
# and the weights answer with the trigger's reply (one token), then end the turn. The calls are in the Hermes/Qwen
# form the template renders past calls in, so the engine reads them back as tool calls (and, offered tools with
# tool_choice auto, still accepts the plain answer: a call opens with a tag).
AGENT_REPLIES: dict[str, str] = {
    "<|read_notes|>": '<tool_call>\n{"name": "Read", "arguments": {"file_path": "notes.txt"}}\n</tool_call>',
    "<|get_time|>": '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>',
    "<|answer|>": "Done.",
}

# The script, in the template: once a tool result is in the conversation, or without tools, it answers; offered
# Claude Code's Read tool and asked about notes.txt, it reads notes.txt; offered the certification's get_time, it
# calls get_time (UTC); anything else (OpenClaw's tools, say) gets the answer. Past calls and results render as
# Qwen 2.5 renders them (<tool_call> JSON, <tool_response>), which llama.cpp's template analysis understands.
AGENT_TEMPLATE = (
    "{%- set ns = namespace(answered=false, read=false, clock=false, asked=false) -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message.role == 'tool' -%}{%- set ns.answered = true -%}\n"
    "{%- elif message.role == 'user' and 'notes.txt' in (message.content | string) -%}{%- set ns.asked = true -%}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if tools -%}\n"
    "{%- for tool in tools -%}\n"
    "{%- set name = tool.function.name if tool.function is defined else tool.name -%}\n"
    "{%- if name == 'Read' -%}{%- set ns.read = true -%}{%- elif name == 'get_time' -%}{%- set ns.clock = true -%}"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}# Tools\n\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}\n{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' -%}\n"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) -%}\n"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' -%}\n"
    "<|im_start|>assistant\n"
    "{%- if message.content %}\n{{ message.content }}{% endif -%}\n"
    "{%- for tool_call in message.tool_calls -%}\n"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}\n"
    "<tool_call>\n{\"name\": \"{{ call.name }}\", \"arguments\": {{ call.arguments | tojson }}}\n</tool_call>\n"
    "{%- endfor -%}\n"
    "<|im_end|>\n"
    "{% elif message.role == 'tool' -%}\n"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "<|im_start|>assistant\n"
    "{% if ns.answered or not tools %}<|answer|>{% elif ns.read and ns.asked %}<|read_notes|>"
    "{% elif ns.clock %}<|get_time|>{% else %}<|answer|>{% endif %}\n"
    "{%- endif -%}\n"
)

# The logit a scripted token gives its successor; every other logit stays near 0 (p(successor) > 1 - 1e-9 over a
# thousand tokens at temperature 1).
_SCRIPT_LOGIT = 30.0


def write_scripted_model(
    path: str | Path,
    replies: Mapping[str, str] = AGENT_REPLIES,
    chat_template: str = AGENT_TEMPLATE,
    *,
    n_ctx_train: int = 4096,
    n_embd: int = 32,
    file_type: str = "q8_0",
    name: str | None = None,
    seed: int = 0,
) -> Path:
    """Write a one-layer llama model that says what its chat template asks: each trigger of ``replies`` (a control
    token the template puts at the end of the generation prompt) is followed by its reply (one token), and the
    reply by the end of the turn (``<|im_end|>``).

    The next token depends on the current token only: the attention and feed-forward outputs are zero, so each
    position carries its own embedding to the output. A scripted token's embedding is its own unit vector and the
    output weights map it to its successor; every other token has a random embedding outside those directions and
    near-uniform logits, as the random models have. The vocabulary is ``build_vocab``'s with every merge (fewer
    tokens for a long agent prompt than the default models), then one token per reply (its text, byte-encoded as
    the vocabulary's) and one control token per trigger. One layer and a narrow embedding keep a prompt of tens of
    thousands of tokens (Claude Code's, OpenClaw's) to seconds on a CPU.
    """
    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type {file_type!r} is not one of {', '.join(FILE_TYPES)}")
    qtype, ftype = FILE_TYPES[file_type]
    tokens, types, merges = build_vocab(256 + sum(1 for _ in _merge_pairs()) + len(SPECIAL_TOKENS))
    to_unicode = bytes_to_unicode()
    texts = ["".join(to_unicode[byte] for byte in reply.encode()) for reply in replies.values()]
    triggers = list(replies)
    if len({*texts, *triggers, *tokens}) != len(tokens) + len(texts) + len(triggers):
        raise ValueError("every trigger and reply must be a token of its own")
    tokens += texts + triggers
    types += [int(TokenType.NORMAL)] * len(texts) + [int(TokenType.CONTROL)] * len(triggers)
    end = tokens.index("<|im_end|>")
    successors = {}
    for trigger, text in zip(triggers, texts):
        successors[tokens.index(trigger)] = tokens.index(text)
        successors[tokens.index(text)] = end
    if len(successors) >= n_embd:
        raise ValueError(f"{len(successors)} scripted tokens need an embedding wider than {n_embd}")
    shape = ModelShape(
        # Two KV heads: a K/V row as wide as the embedding, so a quantised cache's 32-wide blocks fit it.
        arch="llama", n_layer=1, n_embd=n_embd, n_head=2, n_head_kv=2, n_ff=2 * n_embd, n_vocab=len(tokens),
        n_ctx_train=n_ctx_train, head_dim=n_embd // 2, n_expert=0, n_expert_used=0, n_ff_exp=0, sliding_window=0,
        swa_pattern=2, tied_embeddings=False,
    )
    _check_shape(shape, qtype)
    metadata = _metadata(shape, ftype, name or "tiny-scripted-llama", chat_template)
    metadata.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                     "tokenizer.ggml.merges": merges, "tokenizer.ggml.eos_token_id": end,
                     "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
                     "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>")})
    rng = np.random.default_rng([seed, 1])
    scripted = len(successors)
    embedding = np.zeros((len(tokens), n_embd), dtype=np.float32)
    embedding[:, scripted:] = rng.standard_normal((len(tokens), n_embd - scripted), dtype=np.float32) * _WEIGHT_STD
    output = rng.standard_normal((len(tokens), n_embd), dtype=np.float32) * _WEIGHT_STD
    for direction, (token, successor) in enumerate(successors.items()):
        embedding[token] = 0.0
        embedding[token, direction] = 1.0
        output[successor, direction] = _SCRIPT_LOGIT / np.sqrt(n_embd)  # the norm scales a unit vector by sqrt(n_embd)
    specs = _tensor_specs(shape, qtype)
    values = {_name(MODEL_TENSOR.TOKEN_EMBD): embedding, _name(MODEL_TENSOR.OUTPUT): output}
    values |= {spec.name: np.zeros(spec.shape, dtype=np.float32) for spec in specs
               if spec.name in (_name(MODEL_TENSOR.ATTN_OUT, 0), _name(MODEL_TENSOR.FFN_DOWN, 0))}
    return write_gguf(path, "llama", metadata, specs, seed=seed, values=values)
