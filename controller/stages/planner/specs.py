"""What the planner knows about a model's memory before anything is downloaded.

Three sources, best first:

* a GGUF header (local path or URL; only the header is read) — exact tensor shapes and types;
* the catalog's published hyperparameters (``arch`` + ``hparams``): the tensors llama.cpp would
  load are rebuilt from the architecture's layout and sized for the file's quantisation, then
  scaled to the catalog's file size when one is known, so per-layer and expert/non-expert shares
  are right even for mixed quantisations whose exact per-tensor types are not published;
* the kit's measured figures (file size, KV bytes per token), or the file size alone: a coarse
  model that can place a model on whole devices but not split off its experts.

The first two become an estimator ``ModelSpec``; the planner asks every source the same question
through ``MemoryModel``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from controller.errors import CatalogError
from controller.model.catalog import ModelEntry
from controller.stages.estimate.gguf_header import GGUFHeader, TensorInfo, read_header
from controller.stages.estimate.memory import (
    CUDA_OVERHEAD_MIB,
    MIB,
    Estimate,
    Settings,
    estimate,
    place_layers,
    weights_per_device,
)
from controller.stages.estimate.model import ModelSpec, model_spec

T = GGMLQuantizationType
F32 = T.F32

# Weight type of most matrices for each catalog file_type, and of the few tensors quantisers keep
# wider (output layer, and for the K-quant mixes the "more bits" half of attn_v/ffn_down).
_MAIN_TYPE = {
    "F16": T.F16, "BF16": T.BF16, "Q8_0": T.Q8_0, "Q6_K": T.Q6_K, "Q5_K_M": T.Q5_K, "Q4_K_M": T.Q4_K,
    "Q4_0": T.Q4_0, "IQ4_XS": T.IQ4_XS, "IQ4_NL": T.IQ4_NL, "Q3_K_M": T.Q3_K, "MXFP4": T.MXFP4,
}
_WIDE_TYPE = {"Q4_K_M": T.Q6_K, "Q5_K_M": T.Q6_K, "Q3_K_M": T.Q5_K, "Q4_0": T.Q6_K, "IQ4_XS": T.Q6_K}
HEADER_BYTES_PER_TOKEN = 24  # vocabulary strings, scores and types in the GGUF metadata, per token


class MemoryModel(Protocol):
    """Per-device MiB (CUDA0.., then CPU) of a model under given server settings."""

    spec: ModelSpec | None
    notes: list[str]

    def device_mib(self, settings: Settings) -> list[float]: ...


@dataclass
class SpecMemory:
    """The estimator's answer, from a header or from catalog hyperparameters.

    The planner asks for hundreds of contexts per placement; the weights only depend on where the
    layers go, so they are computed once per placement and the rest (KV, compute, CUDA context)
    from a copy of the spec without its tensor list.
    """

    spec: ModelSpec
    source: str
    notes: list[str] = field(default_factory=list)
    _weights: dict[tuple, list[float]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._shell = replace(self.spec, tensors=[])

    def rest(self, settings: Settings) -> Estimate:
        """The estimate without weights: KV, compute buffers and per-device overhead."""
        return estimate(self._shell, settings)

    def device_mib(self, settings: Settings) -> list[float]:
        key = (settings.gpus, settings.gpu_mem_mib, settings.split_mode, settings.n_gpu_layers, settings.cpu_moe,
               settings.cpu_repack)
        weights = self._weights.get(key)
        if weights is None:
            weights = self._weights[key] = weights_per_device(self.spec, settings, place_layers(self.spec, settings))
        return [device.total_mib + w / MIB for device, w in zip(self.rest(settings).devices, weights)]


@dataclass
class SizedMemory:
    """Weights from the file size; KV from measured bytes per token, or a flat allowance without them.

    Compute buffers are not derivable without the model's shape, so they are a flat allowance per
    GPU; the weights split across GPUs in proportion to each GPU's share.
    """

    size_bytes: int
    kv_bytes_per_token: dict[str, int]
    source: str
    spec: ModelSpec | None = None
    notes: list[str] = field(default_factory=list)

    # Without the model's shape: the 1536 MiB per card the first planner reserved, less the CUDA context.
    COMPUTE_ALLOWANCE_MIB = 368.0
    KV_ALLOWANCE_MIB = 768.0

    def kv_mib(self, settings: Settings) -> float:
        per_token = self.kv_bytes_per_token.get(settings.cache_type_k)
        if per_token is None:
            return self.KV_ALLOWANCE_MIB
        return per_token * settings.ctx / MIB

    def device_mib(self, settings: Settings) -> list[float]:
        weights = self.size_bytes / MIB
        kv = self.kv_mib(settings)
        if not settings.gpus:
            return [weights + kv + self.COMPUTE_ALLOWANCE_MIB]
        memory = list(settings.gpu_mem_mib) or [1.0] * len(settings.gpus)
        shares = [m / sum(memory) for m in memory]
        gpu = [(weights + kv) * share + self.COMPUTE_ALLOWANCE_MIB + CUDA_OVERHEAD_MIB for share in shares]
        return gpu + [0.0]


def memory_model(entry: ModelEntry, header: str | GGUFHeader | None = None) -> MemoryModel:
    """The best memory model available for a catalog entry, without downloading tensor data.

    ``header`` is a GGUF path or URL (only its header is read), or a header already read.
    """
    if header is not None:
        header = header if isinstance(header, GGUFHeader) else read_header(header)
        spec = model_spec(header)
        return SpecMemory(spec, f"the GGUF header of {header.source}", list(spec.notes))
    if entry.hparams:
        spec = spec_from_hparams(entry)
        return SpecMemory(spec, f"published hyperparameters of {entry.id}", list(spec.notes))
    if entry.size_bytes:
        what = "the kit's measured figures" if entry.measured else "the catalog's file size alone"
        notes = [] if entry.kv_bytes_per_token else [
            f"{entry.id}: no hyperparameters or measured KV figures in the catalog; KV cache and compute are a "
            f"flat allowance, not an estimate (add arch/hparams to the catalog entry for a real estimate)"
        ]
        return SizedMemory(entry.size_bytes, dict(entry.kv_bytes_per_token), f"{what} for {entry.id}", notes=notes)
    raise CatalogError(
        f"model {entry.id}: the catalog gives neither hyperparameters nor a file size; add 'arch' and 'hparams' "
        f"(or 'size_bytes') to its entry, or plan it from its GGUF header"
    )


# ---------------------------------------------------------------- tensors from hyperparameters


@dataclass(frozen=True)
class _Shape:
    """The hyperparameters that decide tensor shapes, read from the catalog's GGUF-style keys."""

    arch: str
    n_embd: int
    n_vocab: int
    n_layer_all: int
    n_nextn: int
    n_head: list[int]
    n_head_kv: list[int]
    head_k: int
    head_v: int
    head_k_swa: int
    head_v_swa: int
    swa: list[bool]
    recurrent: list[bool]
    n_ff: int
    n_expert: int
    n_ff_exp: int
    n_ff_shexp: int
    ssm_inner: int
    ssm_state: int
    ssm_groups: int
    ssm_rank: int
    ssm_conv: int


def _per_layer(value: object, n: int) -> list[int]:
    if isinstance(value, list):
        return [int(v) for v in value][:n] + [int(value[-1])] * max(0, n - len(value))
    return [int(value or 0)] * n


def _shape(entry: ModelEntry, metadata: dict[str, object]) -> _Shape:
    """Read the shape-deciding keys; the layer kinds come from the estimator's own rules."""
    header = GGUFHeader(f"catalog:{entry.id}", 3, metadata, [], 32, 0)
    spec = model_spec(header)  # layer kinds (full / swa / recurrent / nextn) exactly as the estimator sees them
    hp = entry.hparams
    n_all = spec.n_layer_all
    if not n_all or not spec.n_embd or not spec.n_vocab:
        raise CatalogError(
            f"model {entry.id}: hparams need block_count, embedding_length and vocab_size to size the weights"
        )
    head_k = int(hp.get("attention.key_length", spec.n_embd // max(spec.layers[0].n_head, 1)))
    head_v = int(hp.get("attention.value_length", head_k))
    return _Shape(
        arch=entry.arch or "", n_embd=spec.n_embd, n_vocab=spec.n_vocab, n_layer_all=n_all,
        n_nextn=n_all - spec.n_layer,
        n_head=[layer.n_head for layer in spec.layers], n_head_kv=[layer.n_head_kv for layer in spec.layers],
        head_k=head_k, head_v=head_v,
        head_k_swa=int(hp.get("attention.key_length_swa", head_k)), head_v_swa=int(hp.get("attention.value_length_swa", head_v)),
        swa=[layer.kind == "swa" for layer in spec.layers],
        recurrent=[layer.kind == "recurrent" for layer in spec.layers],
        n_ff=max(_per_layer(hp.get("feed_forward_length", 0), n_all)), n_expert=spec.n_expert,
        n_ff_exp=int(hp.get("expert_feed_forward_length", 0)),
        n_ff_shexp=int(hp.get("expert_shared_feed_forward_length", 0)),
        ssm_inner=int(hp.get("ssm.inner_size", 0)), ssm_state=int(hp.get("ssm.state_size", 0)),
        ssm_groups=int(hp.get("ssm.group_count", 0)), ssm_rank=int(hp.get("ssm.time_step_rank", 0)),
        ssm_conv=int(hp.get("ssm.conv_kernel", 0)),
    )


def _more_bits(il: int, n_layer: int) -> bool:
    """The layers llama.cpp's K-quant mixes give wider attn_v/ffn_down (first and last eighth, every third)."""
    return il < n_layer // 8 or il >= 7 * n_layer // 8 or (il - n_layer // 8) % 3 == 2


def _tensor_type(file_type: str, name: str, il: int | None, n_layer: int) -> GGMLQuantizationType:
    main = _MAIN_TYPE[file_type]
    wide = _WIDE_TYPE.get(file_type, main)
    if name == "output":
        return wide
    if il is not None and name in ("attn_v", "ffn_down", "ffn_down_exps") and file_type.endswith("_K_M"):
        return wide if _more_bits(il, n_layer) else main
    return main


def _nbytes(qtype: GGMLQuantizationType, elements: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return -(-elements * size // block)


def _layer_tensors(s: _Shape, il: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, ggml shape, is_matrix) of one block, in the architecture's GGUF naming."""
    e = s.n_embd
    out: list[tuple[str, tuple[int, ...], bool]] = [("attn_norm", (e,), False)]
    gated_q = s.arch in ("qwen35", "qwen35moe", "qwen3next")  # Q projection also carries the output gate
    if s.recurrent[il]:
        conv = 2 * s.ssm_groups * s.ssm_state + s.ssm_inner
        out += [
            ("attn_qkv", (e, conv), True), ("attn_gate", (e, s.ssm_inner), True),
            ("ssm_beta", (e, s.ssm_rank), True), ("ssm_alpha", (e, s.ssm_rank), True),
            ("ssm_out", (s.ssm_inner, e), True), ("ssm_conv1d", (s.ssm_conv, conv), False),
            ("ssm_a", (s.ssm_rank,), False), ("ssm_dt", (s.ssm_rank,), False), ("ssm_norm", (s.ssm_state,), False),
        ]
    elif s.n_head[il]:
        hk, hv = (s.head_k_swa, s.head_v_swa) if s.swa[il] else (s.head_k, s.head_v)
        q = s.n_head[il] * hk * (2 if gated_q else 1)
        out += [
            ("attn_q", (e, q), True), ("attn_k", (e, s.n_head_kv[il] * hk), True),
            ("attn_v", (e, s.n_head_kv[il] * hv), True), ("attn_output", (s.n_head[il] * hv, e), True),
            ("attn_q_norm", (hk,), False), ("attn_k_norm", (hk,), False),
        ]
    out.append(("post_attention_norm", (e,), False))
    if s.n_expert:
        out.append(("ffn_gate_inp", (e, s.n_expert), False))
        if s.arch.startswith("gemma4"):
            out.append(("ffn_gate_up_exps", (e, 2 * s.n_ff_exp, s.n_expert), True))
        else:
            out += [("ffn_gate_exps", (e, s.n_ff_exp, s.n_expert), True), ("ffn_up_exps", (e, s.n_ff_exp, s.n_expert), True)]
        out.append(("ffn_down_exps", (s.n_ff_exp, e, s.n_expert), True))
        if s.n_ff_shexp:
            out += [
                ("ffn_gate_shexp", (e, s.n_ff_shexp), True), ("ffn_up_shexp", (e, s.n_ff_shexp), True),
                ("ffn_down_shexp", (s.n_ff_shexp, e), True), ("ffn_gate_inp_shexp", (e,), False),
            ]
    if s.n_ff and (not s.n_expert or s.arch.startswith("gemma4")):  # Gemma 4 MoE keeps a dense FFN beside the experts
        out += [("ffn_gate", (e, s.n_ff), True), ("ffn_up", (e, s.n_ff), True), ("ffn_down", (s.n_ff, e), True)]
    out.append(("ffn_norm", (e,), False))
    if il >= s.n_layer_all - s.n_nextn:
        out += [("nextn.eh_proj", (2 * e, e), True), ("nextn.enorm", (e,), False), ("nextn.hnorm", (e,), False)]
    return out


def spec_from_hparams(entry: ModelEntry) -> ModelSpec:
    """A header-only ModelSpec for a catalog entry, with tensors rebuilt from its hyperparameters."""
    if not entry.arch:
        raise CatalogError(f"model {entry.id}: hparams without 'arch'; name the GGUF architecture")
    file_type = (entry.file_type or "").upper()
    if file_type not in _MAIN_TYPE:
        raise CatalogError(
            f"model {entry.id}: file_type {entry.file_type!r} is not one of {', '.join(sorted(_MAIN_TYPE))}; "
            f"set it to the GGUF's quantisation"
        )
    metadata: dict[str, object] = {"general.architecture": entry.arch}
    metadata |= {f"{entry.arch}.{key}": value for key, value in entry.hparams.items()}
    s = _shape(entry, metadata)
    n_layer = s.n_layer_all - s.n_nextn
    raw: list[tuple[str, tuple[int, ...], GGMLQuantizationType]] = []

    def add(name: str, shape: tuple[int, ...], matrix: bool, il: int | None, kind: str) -> None:
        qtype = _tensor_type(file_type, kind, il, n_layer) if matrix else F32
        raw.append((name, shape, qtype))

    add("token_embd.weight", (s.n_embd, s.n_vocab), True, None, "token_embd")
    add("output_norm.weight", (s.n_embd,), False, None, "output_norm")
    if not entry.tied_embeddings:
        add("output.weight", (s.n_embd, s.n_vocab), True, None, "output")
    for il in range(s.n_layer_all):
        for kind, shape, matrix in _layer_tensors(s, il):
            add(f"blk.{il}.{kind}.weight", shape, matrix, il, kind)
    header_bytes = s.n_vocab * HEADER_BYTES_PER_TOKEN
    sizes = [_nbytes(qtype, _elements(shape)) for _name, shape, qtype in raw]
    notes: list[str] = []
    if entry.size_bytes:
        sizes, note = _scale_to_file(entry, raw, sizes, header_bytes)
        notes += [note] if note else []
    tensors, offset = [], 0
    for (name, shape, qtype), nbytes in zip(raw, sizes):
        tensors.append(TensorInfo(name, shape, int(qtype), offset, nbytes))
        offset += -(-nbytes // 32) * 32
    header = GGUFHeader(f"catalog:{entry.id}", 3, metadata, tensors, 32, header_bytes,
                        file_size=header_bytes + offset)
    spec = model_spec(header)
    spec.file_type = file_type
    spec.notes += notes
    return spec


def _elements(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


# The catalog's size and the hyperparameters should agree to within a few percent; more means a
# wrong entry (another quantisation, or a file with a vision tower), which is worth saying.
SIZE_AGREEMENT = 0.10


def _scale_to_file(
    entry: ModelEntry, raw: list[tuple[str, tuple[int, ...], GGMLQuantizationType]], sizes: list[int], header: int
) -> tuple[list[int], str | None]:
    """Scale the quantised tensors so the total matches the catalog's file size (mixed-type files)."""
    fixed = sum(n for (_name, _shape, qtype), n in zip(raw, sizes) if qtype == F32) + header
    quantised = sum(n for (_name, _shape, qtype), n in zip(raw, sizes) if qtype != F32)
    factor = (entry.size_bytes - fixed) / quantised if quantised else 1.0
    scaled = [n if qtype == F32 else int(n * factor) for (_name, _shape, qtype), n in zip(raw, sizes)]
    note = None
    if abs(factor - 1) > SIZE_AGREEMENT:
        note = (f"{entry.id}: the catalog's file size ({entry.size_bytes / 2**30:.2f} GiB) is {factor - 1:+.0%} off "
                f"the {entry.file_type} size its hyperparameters give ({(quantised + fixed) / 2**30:.2f} GiB); "
                f"tensors were scaled to the file size")
    return scaled, note
