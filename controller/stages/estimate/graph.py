"""The worst-case graph llama.cpp reserves its compute buffers with, built symbolically for one model.

llama_context::sched_reserve (src/llama-context.cpp, 0c1e570) builds the model's graph for one
micro-batch of T = min(n_ctx, n_ubatch) tokens (rounded up to a multiple of the slots) against every
cell of the KV cache (``init_full``: n_kv is the whole cache, all streams), with one output row per
slot, and reserves each backend's buffer from it (``graph_reserve`` -> ``ggml_backend_sched_reserve``).
This module builds that graph the way the engine does, for the architectures whose graph code is
mirrored here line by line:

* ``llm_graph_context::build_inp_embd`` / ``build_inp_pos`` / ``build_inp_out_ids`` and the attention
  inputs of ``build_attn_inp_kv`` / ``build_attn_inp_kv_iswa`` (token ids, positions, cache indices,
  the KQ mask: f16 with flash attention, [n_kv, T/streams, 1, streams]; the Hadamard rotation matrices
  of a quantised cache, ``llama_kv_cache::build_input_k_rot``), all graph inputs the scheduler keeps on
  the host;
* ``build_norm``, ``build_qkv``, ``build_attn`` (``cpy_k``/``cpy_v`` into the cache, ``get_k``/``get_v``
  views of every cell), ``build_attn_mha`` (flash attention or KQ, softmax and KQV), ``build_ffn``
  (the gated FFN) and ``build_moe_ffn`` (router logits, top-k, ``ggml_mul_mat_id`` over the used
  experts, the weighted sum of the experts' outputs);
* the block layouts of src/models/llama.cpp, qwen2.cpp, qwen3.cpp, qwen3moe.cpp and gemma3.cpp.

Weights and the KV cache are leafs in pre-allocated buffers on the device of their layer (the token
embeddings always on the host); ``controller.stages.estimate.sched`` assigns the nodes to backends and sizes
the buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.stages.estimate.ggml import (
    F16,
    F32,
    I32,
    I64,
    OUTPUT,
    Buffer,
    BufferType,
    Graph,
    Tensor,
    argsort_top_k,
    binary,
    cast,
    cont,
    cont_2d,
    flash_attn_ext,
    get_rows,
    glu_split,
    is_quantized,
    mul_mat,
    mul_mat_id,
    new_tensor,
    permute,
    reshape,
    rope,
    row_size,
    set_input,
    set_rows,
    soft_max_ext,
    sum_rows,
    transpose,
    unary,
    view,
)
from controller.stages.estimate.gguf_header import TensorInfo
from controller.stages.estimate.model import ModelSpec, cache_type, tensor_layer

# Architectures whose block graph is mirrored here: flags for the per-arch differences.
ARCHS = {
    "llama": {"qk_norm": False, "gemma": False},
    "qwen2": {"qk_norm": False, "gemma": False},
    "qwen3": {"qk_norm": True, "gemma": False},
    "qwen3moe": {"qk_norm": True, "gemma": False},
    "gemma3": {"qk_norm": True, "gemma": True},
}
LOW_BATCH = 32  # llama_context::graph_get_cb pins layer norms to their layer's device below this batch
KEEP_PERIODS = 3  # identical layers kept at each end of a run when the graph is compressed
MAX_PERIOD = 16  # the longest repeating pattern of layer kinds looked for (Gemma 3: 6, gpt-oss: 2)


@dataclass(frozen=True)
class Shape:
    """The reserve pass's micro-batch against the cache."""

    n_tokens: int
    n_seqs: int
    n_outputs: int
    cells: int  # per stream, full-attention layers
    swa_cells: int
    streams: int  # KV streams: 1 unified, else one per slot
    flash_attn: bool
    type_k: int
    type_v: int


@dataclass
class Built:
    graph: Graph
    pins: list[tuple[Tensor, int]]  # tensors the graph callback assigns to a backend


def supported(spec: ModelSpec) -> bool:
    """Whether this module mirrors the model's graph (the estimator falls back to a formula otherwise)."""
    if spec.arch not in ARCHS or spec.mla or not spec.n_layer or not spec.n_embd or not spec.n_vocab:
        return False
    attn = [layer for layer in spec.layers[:spec.n_layer]]
    return all(layer.kind in ("full", "swa") and layer.n_head and layer.n_head_kv and layer.head_k for layer in attn)


class _Builder:
    """llm_graph_context and the model's graph constructor, for one placement of the layers."""

    def __init__(self, spec: ModelSpec, shape: Shape, layer_device: list[int], output_device: int, cpu: int,
                 bufts: list[BufferType], full_offload: bool, tensors: dict[str, TensorInfo],
                 layers: list[int]) -> None:
        self.spec = spec
        self.layers = layers
        self.s = shape
        self.flags = ARCHS[spec.arch]
        self.layer_device = layer_device
        self.output_device = output_device
        self.cpu = cpu
        self.bufts = bufts
        self.tensors = tensors
        self.gf = Graph()
        self.pins: list[tuple[Tensor, int]] = []
        self.pin_norms = full_offload or shape.n_tokens < LOW_BATCH
        self._weights: dict[tuple[str, int], Tensor] = {}
        self.n_tokens = shape.n_tokens

    # -------------------------------------------------- leafs

    def weight(self, name: str, shape: tuple[int, ...], device: int, required: bool = True) -> Tensor | None:
        """A weight leaf in its device's weight buffer; shapes come from the header, else from the hyperparameters."""
        key = (name, device)
        if key in self._weights:
            return self._weights[key]
        info = self.tensors.get(name)
        if info is None and not required:
            return None
        if info is not None:
            t = new_tensor(info.ggml_type, *info.shape, name=name)
        else:
            qtype = F32 if len(shape) == 1 else F16
            t = new_tensor(qtype, *shape, name=name)
        t.buffer = Buffer(self.bufts[device], weights=True)
        self._weights[key] = t
        return t

    def kv_tensor(self, name: str, qtype: int, width: int, cells: int, device: int) -> Tensor:
        t = new_tensor(qtype, width, cells, self.s.streams, name=name)
        t.buffer = Buffer(self.bufts[device], weights=False)
        return t

    # -------------------------------------------------- helpers of llm_graph_context

    def norm(self, cur: Tensor, weight: Tensor | None, il: int) -> Tensor:
        cur = unary("RMS_NORM", cur)
        if weight is not None:
            if il >= 0 and self.pin_norms:
                self.pins.append((cur, self.layer_device[il]))
            cur = binary("MUL", cur, weight)
        return cur

    def hadamard(self, cur: Tensor, rot: Tensor) -> Tensor:
        n = rot.ne[0]
        if not cur.is_contiguous():
            res = cont_2d(cur, n, cur.nelements // n)
        else:
            res = reshape(cur, n, cur.nelements // n)
        res = mul_mat(rot, res)
        return reshape(res, *cur.ne)

    def qkv(self, il: int, cur: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        layer = self.spec.layers[il]
        dev = self.layer_device[il]
        e, hd_k, hd_v = self.spec.n_embd, layer.head_k, layer.head_v
        n_q, n_k, n_v = layer.n_head * hd_k, layer.n_head_kv * hd_k, layer.n_head_kv * hd_v
        t = self.n_tokens
        fused = self.weight(f"blk.{il}.attn_qkv.weight", (e, n_q + n_k + n_v), dev, required=False)
        if fused is not None:
            qkv = mul_mat(fused, cur)
            bias = self.weight(f"blk.{il}.attn_qkv.bias", (n_q + n_k + n_v,), dev, required=False)
            if bias is not None:
                qkv = binary("ADD", qkv, bias)
            q = view(qkv, [hd_k, layer.n_head, t], [row_size(qkv.type, hd_k), qkv.nb[1]], 0)
            k = view(qkv, [hd_k, layer.n_head_kv, t], [row_size(qkv.type, hd_k), qkv.nb[1]], row_size(qkv.type, n_q))
            v = view(qkv, [hd_v, layer.n_head_kv, t], [row_size(qkv.type, hd_v), qkv.nb[1]],
                     row_size(qkv.type, n_q + n_k))
            return q, k, v
        out = []
        for part, width in (("q", n_q), ("k", n_k), ("v", n_v)):
            x = mul_mat(self.weight(f"blk.{il}.attn_{part}.weight", (e, width), dev), cur)
            bias = self.weight(f"blk.{il}.attn_{part}.bias", (width,), dev, required=False)
            if bias is not None:
                x = binary("ADD", x, bias)
            out.append(x)
        q = reshape(out[0], hd_k, layer.n_head, t)
        k = reshape(out[1], hd_k, layer.n_head_kv, t)
        v = reshape(out[2], hd_v, layer.n_head_kv, t)
        return q, k, v

    def attn_mha(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        v_trans = v.nb[1] > v.nb[2]
        ns = k.ne[3]
        q = view(q, [q.ne[0], q.ne[1], q.ne[2] // ns, ns], [q.nb[1], q.nb[2], q.nb[2] * (q.ne[2] // ns)], 0)
        q = permute(q, 0, 2, 1, 3)
        k = permute(k, 0, 2, 1, 3)
        v = permute(v, 0, 2, 1, 3)
        if self.s.flash_attn:
            if v_trans:
                v = transpose(v)
            if k.type == F32:
                k = cast(k, F16)
            if v.type == F32:
                v = cast(v, F16)
            cur = flash_attn_ext(q, k, v, mask)
            cur = reshape(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        else:
            kq = mul_mat(k, q)
            kq = soft_max_ext(kq, mask)
            if not v_trans:
                v = cont(transpose(v))
            kqv = mul_mat(v, kq)
            cur = permute(kqv, 0, 2, 1, 3)
            cur = cont_2d(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        self.gf.expand(cur)
        return cur

    def ffn(self, il: int, cur: Tensor) -> Tensor:
        """build_ffn with a parallel gate: up and gate products, swiglu/geglu (same shapes), down."""
        dev = self.layer_device[il]
        e, ff = self.spec.n_embd, self._n_ff(il)
        up = mul_mat(self.weight(f"blk.{il}.ffn_up.weight", (e, ff), dev), cur)
        gate = mul_mat(self.weight(f"blk.{il}.ffn_gate.weight", (e, ff), dev), cur)
        cur = glu_split(gate, up)  # swiglu / geglu of (gate, up)
        return mul_mat(self.weight(f"blk.{il}.ffn_down.weight", (ff, e), dev), cur)

    def _n_ff(self, il: int) -> int:
        info = self.tensors.get(f"blk.{il}.ffn_up.weight")
        return info.shape[1] if info is not None else self.spec.n_ff

    def moe_ffn(self, il: int, cur: Tensor) -> Tensor:
        dev = self.layer_device[il]
        spec = self.spec
        e, t = spec.n_embd, cur.ne[1]  # the last layer routes only the output rows
        n_expert, n_used = spec.n_expert, spec.n_expert_used
        ff = spec.n_ff_exp or spec.n_ff
        logits = mul_mat(self.weight(f"blk.{il}.ffn_gate_inp.weight", (e, n_expert), dev), cur)
        probs = unary("SOFT_MAX", logits)
        selected = argsort_top_k(probs, n_used)
        probs = reshape(probs, 1, n_expert, t)
        weights = get_rows(probs, selected)
        weights = reshape(weights, n_used, t)
        weights_sum = unary("CLAMP", sum_rows(weights))
        weights = binary("DIV", weights, weights_sum)
        weights = reshape(weights, 1, n_used, t)
        self.gf.expand(weights)
        cur = reshape(cur, e, 1, t)
        up = mul_mat_id(self.weight(f"blk.{il}.ffn_up_exps.weight", (e, ff, n_expert), dev), cur, selected)
        gate_w = self.weight(f"blk.{il}.ffn_gate_exps.weight", (e, ff, n_expert), dev, required=False)
        gate = mul_mat_id(gate_w, cur, selected) if gate_w is not None else up
        cur = glu_split(gate, up) if gate_w is not None else unary("UNARY", gate)
        experts = mul_mat_id(self.weight(f"blk.{il}.ffn_down_exps.weight", (ff, e, n_expert), dev), cur, selected)
        experts = binary("MUL", experts, weights)
        self.gf.expand(experts)
        views = []
        for i in range(n_used):
            views.append(view(experts, [e, t], [experts.nb[2]], i * experts.nb[1]))
            self.gf.expand(views[-1])
        out = views[0]
        for i in range(1, n_used):
            out = binary("ADD", out, views[i])
            self.gf.expand(out)
        if n_used == 1:
            out = cont(out)
        return out

    # -------------------------------------------------- the KV cache and attention inputs

    def _caches(self) -> None:
        s, spec = self.s, self.spec
        self.k_cache: dict[int, Tensor] = {}
        self.v_cache: dict[int, Tensor] = {}
        layers = [layer for layer in spec.layers[:spec.n_layer] if layer.kind in ("full", "swa")]
        self.v_width_max = max(layer.v_width for layer in layers)
        for layer in layers:
            cells = s.swa_cells if layer.kind == "swa" else s.cells
            dev = self.layer_device[layer.index]
            v_width = layer.v_width if s.flash_attn else self.v_width_max
            self.k_cache[layer.index] = self.kv_tensor(f"cache_k_l{layer.index}", s.type_k, layer.k_width, cells, dev)
            self.v_cache[layer.index] = self.kv_tensor(f"cache_v_l{layer.index}", s.type_v, v_width, cells, dev)

    def _attn_inputs(self, swa: bool) -> dict[str, Tensor | None]:
        s = self.s
        t = self.n_tokens
        cells = s.swa_cells if swa else s.cells
        v_idx = t if s.flash_attn else t * self.v_width_max
        inp = {
            "k_idxs": set_input(new_tensor(I64, t), "attn_inp_k_idxs"),
            "v_idxs": set_input(new_tensor(I64, v_idx), "attn_inp_v_idxs"),
            "mask": set_input(new_tensor(F16 if s.flash_attn else F32, cells, t // s.streams, 1, s.streams),
                              "attn_inp_kq_mask"),
        }
        heads_k = {layer.head_k for layer in self.spec.layers[:self.spec.n_layer] if layer.kind in ("full", "swa")}
        heads_v = {layer.head_v for layer in self.spec.layers[:self.spec.n_layer] if layer.kind in ("full", "swa")}
        head_k = heads_k.pop() if len(heads_k) == 1 else 0
        head_v = heads_v.pop() if len(heads_v) == 1 else 0
        inp["k_rot"] = inp["v_rot"] = None
        if head_k and is_quantized(s.type_k) and head_k % 64 == 0:
            nrot = 64
            while head_k % (nrot * 2) == 0:
                nrot *= 2
            inp["k_rot"] = set_input(new_tensor(F32, nrot, nrot), "attn_inp_k_rot")
        if head_v and is_quantized(s.type_v) and head_v % 64 == 0:
            inp["v_rot"] = set_input(new_tensor(F32, 64, 64), "attn_inp_v_rot")
        return inp

    def attention(self, il: int, wo: Tensor, q: Tensor, k: Tensor, v: Tensor, iswa: bool) -> Tensor:
        s = self.s
        layer = self.spec.layers[il]
        inp = self.inp_swa if layer.kind == "swa" else self.inp
        if inp["k_rot"] is not None:
            q = self.hadamard(q, inp["k_rot"])
            k = self.hadamard(k, inp["k_rot"])
        if inp["v_rot"] is not None:
            v = self.hadamard(v, inp["v_rot"])
        for t in ((q, k, v) if iswa else (q, v, k)):
            self.gf.expand(t)
        kc, vc = self.k_cache[il], self.v_cache[il]
        kv_size, ns = kc.ne[1], s.streams
        # cpy_k
        k_cur = view(k, [layer.k_width, k.ne[2]], [k.nb[2]], 0)
        k_dst = reshape(kc, layer.k_width, kv_size * ns) if ns > 1 else kc
        self.gf.expand(set_rows(k_dst, k_cur, inp["k_idxs"]))
        # cpy_v
        v_width = vc.ne[0]
        if s.flash_attn:
            v_cur = view(v, [layer.v_width, v.ne[2]], [v.nb[2]], 0)
            v_dst = reshape(vc, layer.v_width, kv_size * ns) if ns > 1 else vc
        else:
            if row_size(v.type, layer.v_width) == v.nb[2]:
                v_cur = reshape(v, layer.v_width, v.ne[2])
            else:
                v_cur = cont_2d(v, layer.v_width, v.ne[2])
            if layer.v_width < v_width:  # ggml_pad to the widest layer's V row
                padded = new_tensor(v_cur.type, v_width, *v_cur.ne[1:])
                padded.op, padded.src = "PAD", [v_cur]
                v_cur = padded
            v_dst = reshape(vc, 1, vc.nelements)
            v_cur = reshape(v_cur, 1, v_cur.nelements)
        self.gf.expand(set_rows(v_dst, v_cur, inp["v_idxs"]))
        # get_k / get_v: every cell of every stream
        k_view = view(kc, [layer.head_k, layer.n_head_kv, kv_size, ns],
                      [row_size(kc.type, layer.head_k), row_size(kc.type, kc.ne[0]),
                       row_size(kc.type, kc.ne[0] * kv_size)], 0)
        if s.flash_attn:
            v_view = view(vc, [layer.head_v, layer.n_head_kv, kv_size, ns],
                          [row_size(vc.type, layer.head_v), row_size(vc.type, vc.ne[0]),
                           row_size(vc.type, vc.ne[0] * kv_size)], 0)
        else:
            v_view = view(vc, [kv_size, layer.n_head_kv, layer.head_v, ns],
                          [row_size(vc.type, kv_size * layer.head_v), row_size(vc.type, kv_size),
                           row_size(vc.type, kv_size * vc.ne[0])], 0)
        cur = self.attn_mha(q, k_view, v_view, inp["mask"])
        if inp["v_rot"] is not None:
            cur = self.hadamard(cur, inp["v_rot"])
        cur = mul_mat(wo, cur)
        bias = self.weight(f"blk.{il}.attn_output.bias", (self.spec.n_embd,), self.layer_device[il], required=False)
        if bias is not None:
            cur = binary("ADD", cur, bias)
        return cur

    # -------------------------------------------------- the model

    def build(self) -> Built:
        spec, s = self.spec, self.s
        e, t = spec.n_embd, self.n_tokens
        gemma = self.flags["gemma"]
        iswa = any(layer.kind == "swa" for layer in spec.layers[:spec.n_layer])
        # build_inp_embd: get_rows of the token embeddings (on the host), selected with the raw-embeddings input
        tok_embd = self.weight("token_embd.weight", (e, spec.n_vocab), self.cpu)
        tokens = set_input(new_tensor(I32, t), "inp_tokens")
        embd_in = set_input(new_tensor(F32, tok_embd.ne[0], t), "inp_embd")
        inp_l = get_rows(tok_embd, tokens)
        self.gf.expand(inp_l)
        self.gf.expand(embd_in)
        if gemma:
            inp_l = unary("SCALE", inp_l)
        pos = set_input(new_tensor(I32, t), "inp_pos")
        self._caches()
        self.inp = self._attn_inputs(False)
        self.inp_swa = self._attn_inputs(True) if iswa else self.inp
        out_ids = set_input(new_tensor(I32, s.n_outputs), "out_ids")
        for il in self.layers:
            layer = spec.layers[il]
            dev = self.layer_device[il]
            inp_sa = inp_l
            cur = self.norm(inp_l, self.weight(f"blk.{il}.attn_norm.weight", (e,), dev), il)
            q, k, v = self.qkv(il, cur)
            if self.flags["qk_norm"]:
                q = self.norm(q, self.weight(f"blk.{il}.attn_q_norm.weight", (layer.head_k,), dev), il)
                q = rope(q, pos)
                k = self.norm(k, self.weight(f"blk.{il}.attn_k_norm.weight", (layer.head_k,), dev), il)
                k = rope(k, pos)
            else:
                q = rope(q, pos)
                k = rope(k, pos)
            if gemma:
                q = unary("SCALE", q)
            wo = self.weight(f"blk.{il}.attn_output.weight", (layer.n_head * layer.head_v, e), dev)
            cur = self.attention(il, wo, q, k, v, iswa)
            if il == spec.n_layer - 1:
                cur = get_rows(cur, out_ids)
                inp_sa = get_rows(inp_sa, out_ids)
            if gemma:
                cur = self.norm(cur, self.weight(f"blk.{il}.post_attention_norm.weight", (e,), dev), il)
            ffn_inp = binary("ADD", cur, inp_sa)
            cur = self.norm(ffn_inp, self.weight(f"blk.{il}.ffn_norm.weight", (e,), dev), il)
            if spec.n_expert and f"blk.{il}.ffn_up.weight" not in self.tensors:
                cur = self.moe_ffn(il, cur)
            else:
                cur = self.ffn(il, cur)
            if gemma:
                cur = self.norm(cur, self.weight(f"blk.{il}.post_ffw_norm.weight", (e,), dev), -1)
            inp_l = binary("ADD", cur, ffn_inp)
        cur = self.norm(inp_l, self.weight("output_norm.weight", (e,), self.output_device), -1)
        cur.flags |= OUTPUT  # t_embd
        name = "output.weight" if "output.weight" in self.tensors or not self.tensors else "token_embd.weight"
        output = self.weight(name, (e, spec.n_vocab), self.output_device)
        logits = mul_mat(output, cur)
        logits.flags |= OUTPUT  # t_logits
        self.gf.expand(logits)
        return Built(self.gf, self.pins)


def build_graph(spec: ModelSpec, shape: Shape, layer_device: list[int], output_device: int, cpu: int,
                bufts: list[BufferType], full_offload: bool, compress: bool = True) -> Built:
    """The reserve graph of ``spec`` with layers on ``layer_device`` (indices into ``bufts``, the CPU last).

    With ``compress``, long runs of identical layers are shortened (``layer_plan``): the buffers come
    out the same, and the planner can afford to ask for hundreds of contexts.
    """
    tensors = spec.graph_tensors or {info.name: info for info in spec.tensors}
    layers = layer_plan(spec, layer_device, tensors, cpu) if compress else list(range(spec.n_layer))
    return _Builder(spec, shape, layer_device, output_device, cpu, bufts, full_offload, tensors, layers).build()


def _signatures(spec: ModelSpec, layer_device: list[int], tensors: dict[str, TensorInfo], n: int,
                copied: int) -> list[tuple]:
    """What makes two layers allocate alike: kind, device, heads, weight shapes, and weight types where
    the weights are copied to a GPU for the batch (layers on device ``copied``); elsewhere the graph's
    tensors are f32 whatever the weights' type."""
    grouped = _by_layer(tensors)
    sigs = []
    for il, layer in enumerate(spec.layers[:n]):
        own = grouped.get(il, ())
        if layer_device[il] != copied:
            own = tuple((name, shape, -1) for name, shape, _qtype in own)
        sigs.append((layer.kind, layer_device[il], layer.n_head, layer.n_head_kv, layer.head_k, layer.head_v, own))
    return sigs


_GROUPED: dict[int, tuple[dict, dict[int, tuple]]] = {}


def _by_layer(tensors: dict[str, TensorInfo]) -> dict[int, tuple]:
    """Each block's tensors as (name within the block, shape, type), sorted; cached per tensor table."""
    cached = _GROUPED.get(id(tensors))
    if cached is not None and cached[0] is tensors:
        return cached[1]
    own: dict[int, list[tuple]] = {}
    for name, info in tensors.items():
        il = tensor_layer(name)
        if il is not None:
            own.setdefault(il, []).append((name.split(".", 2)[2], info.shape, info.ggml_type))
    grouped = {il: tuple(sorted(items)) for il, items in own.items()}
    if len(_GROUPED) > 64:
        _GROUPED.clear()
    _GROUPED[id(tensors)] = (tensors, grouped)
    return grouped


def layer_plan(spec: ModelSpec, layer_device: list[int], tensors: dict[str, TensorInfo], cpu: int = -1) -> list[int]:
    """The layers to build: every layer, less whole periods from the middle of long repeating stretches.

    Identical layers (same kind, device, heads and weight shapes and types) repeat the same allocations
    and frees, so after a couple of repetitions the allocator's free list is periodic and the buffers
    stop growing. Scanning from the first layer, a stretch where a block of ``p`` layers repeats at least
    ``2 * KEEP_PERIODS + 1`` times keeps its first and last ``KEEP_PERIODS`` blocks (removing whole blocks
    keeps the pattern's phase); the last layer (the one that keeps only the output rows) is always built.
    ``tests/unit/estimate/test_graph.py`` checks the buffers against the whole graph.
    """
    n = spec.n_layer
    if n <= 2:
        return list(range(n))
    sigs = _signatures(spec, layer_device, tensors, n - 1, cpu if cpu > 0 else -1)
    keep: list[int] = []
    i, end = 0, n - 1
    while i < end:
        stretch = None
        for p in range(1, min(MAX_PERIOD, (end - i) // (2 * KEEP_PERIODS + 1)) + 1):
            reps = 1
            while i + (reps + 1) * p <= end and sigs[i + reps * p:i + (reps + 1) * p] == sigs[i:i + p]:
                reps += 1
            if reps >= 2 * KEEP_PERIODS + 1:
                stretch = (p, reps)
                break
        if stretch is None:
            keep.append(i)
            i += 1
            continue
        p, reps = stretch
        keep += list(range(i, i + KEEP_PERIODS * p)) + list(range(i + (reps - KEEP_PERIODS) * p, i + reps * p))
        i += reps * p
    return keep + [n - 1]


def shape_for(spec: ModelSpec, ctx: int, ubatch: int, batch: int, parallel: int, unified: bool, cells: int,
              swa_cells: int, flash_attn: bool, cache_k: str, cache_v: str) -> Shape:
    """The reserve pass's batch: T = min(-c, -b, -ub) rounded up to the slots, one output per slot.

    llama_context clamps ``n_batch`` by the context as given, before padding the context to 256
    (src/llama-context.cpp), so ``ctx`` here is the unpadded ``-c``.
    """
    n_tokens = min(ctx, batch, ubatch)
    n_seqs = max(parallel, 1)
    if n_tokens % n_seqs:
        n_tokens = -(-n_tokens // n_seqs) * n_seqs
    return Shape(n_tokens=n_tokens, n_seqs=n_seqs, n_outputs=min(n_tokens, n_seqs), cells=cells,
                 swa_cells=swa_cells or cells, streams=1 if unified else n_seqs, flash_attn=flash_attn,
                 type_k=int(cache_type(cache_k)), type_v=int(cache_type(cache_v)))
