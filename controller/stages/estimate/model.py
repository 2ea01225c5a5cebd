"""Turn a GGUF header into the per-layer facts that decide memory use, the way llama.cpp reads them.

Every number here comes from a header key or a tensor shape; where llama.cpp hard-codes a default
per architecture (the sliding-window pattern, which layers are recurrent), the table below says so
with the source file it mirrors. What cannot be determined is recorded in ``notes`` instead of
being guessed silently, so ``controller estimate`` can say what it could not estimate.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, LlamaFileType

from controller.stages.estimate.gguf_header import GGUFHeader, GGUFHeaderError, TensorInfo, number

# A transformer of more blocks than this does not exist; a bigger block_count is a corrupt header.
MAX_LAYERS = 4096

# Default sliding-window pattern (every n-th layer is full attention) when the GGUF stores a window
# but no pattern, and whether the pattern puts the full-attention layer first. Mirrors the
# ``load_swa_pattern(ml, n[, dense_first])`` calls in llama.cpp 0c1e570 src/models/*.cpp.
SWA_DEFAULT_PATTERN: dict[str, tuple[int, bool]] = {
    "gemma2": (2, False), "gemma3": (6, False), "gemma3n": (5, False), "gemma-embedding": (6, False),
    "cohere2": (4, False), "cohere2moe": (4, True), "llama4": (4, False), "gpt-oss": (2, False),
    "exaone4": (4, False), "exaone-moe": (4, False), "olmo2": (4, False), "afmoe": (4, False),
    "mellum": (4, False), "plamo3": (8, False), "smallthinker": (4, True), "laguna": (4, True),
    "muse-glimmer": (4, False), "modern-bert": (3, True),
}
# Architectures whose sliding window is only active when the GGUF stores a non-zero window.
SWA_OPTIONAL = {"gemma3", "olmo2", "exaone4", "afmoe", "mellum", "plamo3", "modern-bert", "smallthinker", "laguna"}

# Pure recurrent models keep a fixed-size state per sequence, no KV cache (llama-arch.cpp
# llm_arch_is_recurrent); hybrid ones mix state layers with attention layers (llm_arch_is_hybrid).
RECURRENT_ARCHS = {"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"}
HYBRID_ARCHS = {
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe",
    "qwen3next", "kimi-linear", "qwen35", "qwen35moe", "minimax-01",
}
# Hybrids whose attention layers are every n-th layer unless the GGUF lists the recurrent layers.
HYBRID_FULL_ATTENTION_INTERVAL = {"qwen3next": 4, "qwen35": 4, "qwen35moe": 4}

_EXPERT_TENSOR = re.compile(r"\.ffn_(up|down|gate|gate_up)_exps\.")
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class Layer:
    """Attention facts of one block: its kind and the per-token K/V widths it needs."""

    index: int
    kind: str  # "full", "swa", "recurrent", "nextn" (MTP head, not in the main context) or "none"
    n_head: int
    n_head_kv: int
    head_k: int
    head_v: int

    @property
    def k_width(self) -> int:
        return self.head_k * self.n_head_kv

    @property
    def v_width(self) -> int:
        return self.head_v * self.n_head_kv


@dataclass
class ModelSpec:
    """What the memory model needs from a GGUF, resolved once from its header."""

    arch: str
    n_layer: int  # main (trunk) layers, without MTP/NextN layers
    n_layer_all: int
    n_ctx_train: int
    n_embd: int
    n_vocab: int
    n_ff: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_swa: int
    layers: list[Layer]
    mla: bool
    kv_lora_rank: int  # MLA latent width (DeepSeek-style), 0 when the model has none
    n_rot: int
    recurrent_r: int  # per-sequence conv/shift state width of a recurrent layer (f32 elements)
    recurrent_s: int  # per-sequence SSM/WKV state width of a recurrent layer (f32 elements)
    params: int
    file_type: str
    size_bytes: int
    tensors: list[TensorInfo]
    notes: list[str] = field(default_factory=list)
    # The tensors by name, kept when a copy of the spec drops ``tensors`` (the planner's weight-free shell):
    # the compute graph needs the shapes and types of the weights it reads.
    graph_tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def tied_embeddings(self) -> bool:
        return not any(t.name == "output.weight" for t in self.tensors)


def _per_layer(value: int | list[int] | None, n_layer: int, default: int = 0) -> list[int]:
    """A GGUF key that is either one number or one number per layer (head counts, n_ff), as ``arch_ints`` reads it."""
    if isinstance(value, list):
        return (value + [value[-1] if value else default] * n_layer)[:n_layer]
    return [value if value is not None else default] * n_layer


def _swa_layers(header: GGUFHeader, n_layer_all: int, n_layer: int, notes: list[str]) -> tuple[list[bool], int]:
    """Which layers use the sliding window, and the window, following llama.cpp's per-arch rules."""
    arch = header.arch
    window = header.arch_int("attention.sliding_window")
    pattern = header.arch_value("attention.sliding_window_pattern")
    if window <= 0:
        if arch in SWA_DEFAULT_PATTERN and arch not in SWA_OPTIONAL:
            notes.append(f"{arch} normally has a sliding window but the GGUF stores none; all layers treated as full")
        return [False] * n_layer_all, 0
    if isinstance(pattern, list):
        flags = [bool(v) for v in pattern][:n_layer_all]
        return flags + [False] * (n_layer_all - len(flags)), window
    default = SWA_DEFAULT_PATTERN.get(arch)
    if pattern is None and default is None:
        notes.append(f"{arch}: sliding window {window} but no known layer pattern; all layers treated as full")
        return [False] * n_layer_all, window
    n_pattern = header.arch_int("attention.sliding_window_pattern") if pattern is not None else default[0]
    dense_first = default[1] if default else False
    flags = []
    for il in range(n_layer_all):
        if il >= n_layer:
            flags.append(False)
        elif dense_first:
            flags.append(n_pattern == 0 or il % n_pattern != 0)
        else:
            flags.append(n_pattern == 0 or il % n_pattern < n_pattern - 1)
    return flags, window


def _recurrent_layers(header: GGUFHeader, n_layer_all: int, n_layer: int, n_head_kv: list[int]) -> list[bool]:
    arch = header.arch
    if arch in RECURRENT_ARCHS:
        return [True] * n_layer_all
    if arch not in HYBRID_ARCHS:
        return [False] * n_layer_all
    listed = header.arch_value("attention.recurrent_layers")
    if isinstance(listed, list):
        return [bool(v) for v in listed][:n_layer_all] + [False] * max(0, n_layer_all - len(listed))
    interval = header.arch_int("full_attention_interval", HYBRID_FULL_ATTENTION_INTERVAL.get(arch, 0))
    if interval:
        return [il < n_layer and (il + 1) % interval != 0 for il in range(n_layer_all)]
    # Jamba, Granite hybrid, Nemotron-H and LFM2 mark their state layers with zero KV heads.
    return [il < n_layer and n_head_kv[il] == 0 for il in range(n_layer_all)]


def _recurrent_widths(header: GGUFHeader) -> tuple[int, int]:
    """Per-sequence state widths, mirroring llama_hparams::n_embd_r/n_embd_s."""
    n_embd = header.arch_int("embedding_length")
    wkv = header.arch_int("wkv.head_size")
    if wkv:
        shift = header.arch_int("token_shift_count", 2) or 2
        return shift * n_embd, n_embd * wkv
    conv_l = header.arch_int("shortconv.l_cache")
    if conv_l:
        return n_embd * (conv_l - 1), 0
    d_conv = header.arch_int("ssm.conv_kernel")
    d_inner = header.arch_int("ssm.inner_size")
    d_state = header.arch_int("ssm.state_size")
    n_group = header.arch_int("ssm.group_count")
    conv = max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state)
    return conv, d_state * d_inner


def _file_type(header: GGUFHeader) -> str:
    """The GGUF's declared file type (e.g. Q4_K_M), or the dominant weight type when it is missing."""
    value = header.metadata.get("general.file_type")
    if value is not None:
        try:
            name = LlamaFileType(number(value, "general.file_type", header.source)).name
            return name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            return f"type{value}"
    counts = Counter(t.type_name for t in header.tensors if len(t.shape) >= 2)
    return counts.most_common(1)[0][0] if counts else "unknown"


def _n_vocab(header: GGUFHeader) -> int:
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and tokens:
        return len(tokens)
    if header.arch_int("vocab_size"):
        return header.arch_int("vocab_size")
    for tensor in header.tensors:
        if tensor.name == "token_embd.weight" and len(tensor.shape) == 2:
            return tensor.shape[1]
    return 0


def model_spec(header: GGUFHeader) -> ModelSpec:
    """Resolve a header into a ModelSpec; missing facts become notes rather than exceptions."""
    notes: list[str] = []
    arch = header.arch or "unknown"
    if arch not in set(MODEL_ARCH_NAMES.values()):
        notes.append(
            f"architecture {arch!r} is unknown to gguf-py/llama.cpp: KV assumes plain attention on every layer, "
            "and sliding-window, recurrent or MLA layouts could not be checked"
        )
    n_layer_all = header.arch_int("block_count")
    if not 0 <= n_layer_all <= MAX_LAYERS:
        raise GGUFHeaderError(f"{header.source}: metadata key '{arch}.block_count' is {n_layer_all}, not a layer count "
                              f"(0 to {MAX_LAYERS}); the header is corrupt (re-download or re-convert the model)")
    if not n_layer_all:
        notes.append(f"{arch}: no block_count in the GGUF; KV cache and per-layer placement not estimated")
    n_nextn = header.arch_int("nextn_predict_layers")
    n_layer = n_layer_all - n_nextn
    n_embd = header.arch_int("embedding_length")
    n_head = _per_layer(header.arch_ints("attention.head_count"), n_layer_all)
    n_head_kv = _per_layer(header.arch_ints("attention.head_count_kv"), n_layer_all) if header.arch_value(
        "attention.head_count_kv") is not None else list(n_head)
    first_heads = next((h for h in n_head if h), 0)
    head_k = header.arch_int("attention.key_length", n_embd // first_heads if first_heads else 0) or 0
    head_v = header.arch_int("attention.value_length", n_embd // first_heads if first_heads else 0) or 0
    head_k_swa = header.arch_int("attention.key_length_swa", head_k) or head_k
    head_v_swa = header.arch_int("attention.value_length_swa", head_v) or head_v
    mla = bool(header.arch_value("attention.key_length_mla")) and bool(header.arch_value("attention.value_length_mla"))
    swa, n_swa = _swa_layers(header, n_layer_all, n_layer, notes)
    recurrent = _recurrent_layers(header, n_layer_all, n_layer, n_head_kv)
    shared_kv = header.arch_int("attention.shared_kv_layers")
    layers = []
    for il in range(n_layer_all):
        if il >= n_layer:
            kind = "nextn"
        elif recurrent[il]:
            kind = "recurrent"
        elif shared_kv and il >= n_layer_all - shared_kv:
            kind = "none"  # reuses the KV of an earlier layer (Gemma 3n/4 shared-KV layers)
        elif n_head_kv[il] == 0 and n_head[il] == 0:
            kind = "none"
        else:
            kind = "swa" if swa[il] else "full"
        hk, hv = (head_k_swa, head_v_swa) if swa[il] else (head_k, head_v)
        layers.append(Layer(il, kind, n_head[il], n_head_kv[il], hk, 0 if mla else hv))
    if arch in RECURRENT_ARCHS | HYBRID_ARCHS and not any(_recurrent_widths(header)):
        notes.append(f"{arch}: recurrent state sizes missing from the GGUF; state memory not estimated")
    n_ff = _per_layer(header.arch_ints("feed_forward_length"), max(n_layer_all, 1))
    expert_ff = header.arch_ints("expert_feed_forward_length")
    n_ff_exp = max(_per_layer(expert_ff, max(n_layer_all, 1))) if expert_ff else 0
    size = header.file_size if header.has_tensor_data and header.file_size else header.data_offset + header.tensor_bytes
    if header.unknown_types:
        notes.append(
            f"tensor types {sorted(header.unknown_types)} are unknown to gguf-py; their sizes were taken from tensor offsets"
        )
    return ModelSpec(
        arch=arch, n_layer=n_layer, n_layer_all=n_layer_all,
        n_ctx_train=header.arch_int("context_length"), n_embd=n_embd, n_vocab=_n_vocab(header),
        n_ff=max(n_ff), n_expert=header.arch_int("expert_count"),
        n_expert_used=max(_per_layer(header.arch_ints("expert_used_count"), 1)),
        n_ff_exp=n_ff_exp, n_swa=n_swa, layers=layers, mla=mla,
        kv_lora_rank=header.arch_int("attention.kv_lora_rank"),
        n_rot=header.arch_int("rope.dimension_count", head_k) or head_k,
        recurrent_r=_recurrent_widths(header)[0], recurrent_s=_recurrent_widths(header)[1],
        params=sum(t.n_elements for t in header.tensors), file_type=_file_type(header), size_bytes=size,
        tensors=header.tensors, notes=notes, graph_tensors={t.name: t for t in header.tensors},
    )


def tensor_layer(name: str) -> int | None:
    """Block index of a tensor name (``blk.12.attn_q.weight`` -> 12), None for non-block tensors."""
    match = _LAYER_TENSOR.match(name)
    return int(match.group(1)) if match else None


def is_expert_tensor(name: str) -> bool:
    """Routed-expert weights, the ones ``--cpu-moe`` keeps in host memory."""
    return bool(_EXPERT_TENSOR.search(name))


def is_input_tensor(name: str) -> bool:
    """Tensors llama.cpp places with the input layer, which always stays on the CPU."""
    return name.startswith(("token_embd.", "token_types.", "position_embd.", "per_layer_token_embd."))


QUANT_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")


def cache_type(name: str) -> GGMLQuantizationType:
    """A ``--cache-type-k/v`` value as a ggml type; the engines accept exactly these."""
    if name.lower() not in QUANT_CACHE_TYPES:
        raise ValueError(f"cache type {name!r} is not one of {', '.join(QUANT_CACHE_TYPES)}")
    return GGMLQuantizationType[name.upper()]
