"""Place a symbolic graph on backends and size each backend's compute buffer, as llama.cpp 0c1e570 does.

The engine reserves its compute buffers by running the worst-case graph through two pieces of
ggml-backend, mirrored here rule for rule:

* ``ggml_backend_sched_split_graph`` (ggml/src/ggml-backend.cpp) assigns every node to a backend
  (GPUs first, the CPU last): a node whose result lives in a pre-allocated buffer runs where that
  buffer is; a graph input runs on the CPU; an op on a weight runs where the weight is, unless the
  weight is in host memory and a GPU wants the op (``op_offload``: the CUDA backend takes any op but
  GET_ROWS whose batch is at least 32 rows, ggml-cuda.cu ``ggml_backend_cuda_device_offload_op``);
  then GPU assignments spread to unassigned neighbours, up and down, and the rest follow their
  inputs. The graph is cut into splits where the backend changes (or where a split would need a second
  weight from a backend it cannot read); every source a split cannot read is copied into that
  backend's buffer at the start of the split, once per graph (``tensor_id_copy``).
* ``ggml_gallocr`` (ggml/src/ggml-alloc.c) walks the split graph in order with one dynamic allocator
  per buffer type: inputs first, then each node (in place over a parent whose last use it is, for the
  ops ``ggml_op_can_inplace`` names), freeing each tensor after its last consumer; a free block is
  reused best-fit, otherwise the end of the buffer grows. The buffer is the largest end reached.

A GPU backend sizes a tensor with ``ggml_backend_cuda_buffer_type_get_alloc_size``: flash attention
on CUDA converts a K or V cache that is not f16 to f16 inside its own result (``fattn.cu``,
``ggml_cuda_flash_attn_ext_get_alloc_size``), and quantised rows are padded to 512 elements.
Backends may also keep tensors alive past their last use for fused kernels
(``ggml_backend_cuda_graph_optimize``: the MoE weighted reduction keeps the experts' outputs and
weights until the sum of the experts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.stages.estimate.ggml import (
    F16,
    INPUT,
    OUTPUT,
    VIEW_OPS,
    BufferType,
    Graph,
    Tensor,
    dup_tensor_layout,
    is_quantized,
    row_size,
    view_tensor,
)

OP_OFFLOAD_MIN_BATCH = 32  # ggml-cuda.cu: GGML_OP_OFFLOAD_MIN_BATCH default
CUDA_ALIGNMENT = 128  # ggml_backend_cuda_buffer_type_get_alignment
HOST_ALIGNMENT = 32  # TENSOR_ALIGNMENT: the CPU and CUDA host buffer types
MATRIX_ROW_PADDING = 512  # ggml-cuda common.cuh
MAX_COPIES = 4  # GGML_SCHED_MAX_COPIES: pipeline parallelism keeps this many copies of every input

# ggml-alloc.c ggml_op_can_inplace
INPLACE_OPS = frozenset({
    "FILL", "SCALE", "DIAG_MASK_ZERO", "DIAG_MASK_INF", "ADD", "ADD_ID", "ADD1", "SUB", "MUL", "DIV", "SQR", "SQRT",
    "LOG", "UNARY", "ROPE", "ROPE_BACK", "SILU_BACK", "RMS_NORM", "RMS_NORM_BACK", "CLAMP", "SOFT_MAX",
    "SOFT_MAX_BACK",
})

# CUDA flash attention: head sizes with a kernel (fattn.cu ggml_cuda_get_best_fattn_kernel) and cache types it reads.
FATTN_HEADS = frozenset({40, 64, 72, 80, 96, 112, 128, 256})
FATTN_KQ_STRIDE = 256
FATTN_KV_TYPES = frozenset({0, 1, 30, 2, 3, 6, 7, 8})  # F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
CUDA_GET_ROWS_TYPES = frozenset({0, 1, 30, 26, 2, 3, 6, 7, 8})  # F32, F16, BF16, I32, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0


def _pad(value: int, to: int) -> int:
    return -(-value // to) * to


@dataclass
class Backend:
    """One backend of the scheduler, in priority order (GPUs first, the CPU last)."""

    name: str
    gpu: bool
    buft: BufferType  # where its compute buffer lives (the CPU's is the CUDA host buffer when a GPU exists)

    @property
    def alignment(self) -> int:
        return CUDA_ALIGNMENT if self.gpu else HOST_ALIGNMENT

    def supports_buft(self, buft: BufferType) -> bool:
        if self.gpu:
            return buft.name == self.buft.name
        return buft.host or buft.name == "CPU_REPACK"

    def supports_op(self, t: Tensor) -> bool:
        if not self.gpu:
            return True
        if t.op == "FLASH_ATTN_EXT":
            return cuda_fattn_supported(t)
        if t.op == "GET_ROWS":
            return t.src[0].type in CUDA_GET_ROWS_TYPES
        return True

    def offload_op(self, t: Tensor) -> bool:
        if not self.gpu:
            return False
        if t.op == "GET_ROWS":
            batch = 0
        elif t.op == "MUL_MAT":
            batch = t.ne[1]
        elif t.op in ("MUL_MAT_ID", "ROPE", "ROPE_BACK"):
            batch = t.ne[2]
        else:
            batch = t.nrows
        return batch >= OP_OFFLOAD_MIN_BATCH

    def alloc_size(self, t: Tensor) -> int:
        """ggml_backend_buft_get_alloc_size for this backend's compute buffer type."""
        size = t.nbytes
        if not self.gpu:
            return size
        if t.op == "FLASH_ATTN_EXT":
            size = cuda_fattn_alloc_size(t)
        if is_quantized(t.type) and t.ne[0] % MATRIX_ROW_PADDING:
            size += row_size(t.type, MATRIX_ROW_PADDING - t.ne[0] % MATRIX_ROW_PADDING)
        return size


def cuda_fattn_supported(t: Tensor) -> bool:
    """A CUDA flash-attention kernel exists for these shapes and types (kernel != BEST_FATTN_KERNEL_NONE)."""
    q, k, v, mask = t.src[0], t.src[1], t.src[2], t.src[3]
    gqa_ratio = q.ne[2] // max(k.ne[2], 1)
    gqa_opt = gqa_ratio >= 2 and mask is not None and k.ne[1] % FATTN_KQ_STRIDE == 0
    for tensor in (q, k, v, mask):
        if tensor is not None and not is_quantized(tensor.type) and any(tensor.nb[i] % 16 for i in range(1, 4)):
            gqa_opt = False
    d_k, d_v = k.ne[0], v.ne[0]
    if d_k in FATTN_HEADS:
        ok = d_v == d_k
    elif d_k == 192:
        ok = d_v == 128 and gqa_opt and gqa_ratio % 8 == 0
    elif d_k == 320:
        ok = d_v == 256 and gqa_opt and gqa_ratio % 32 == 0
    elif d_k == 512:
        ok = d_v == 512 and gqa_opt
    elif d_k == 576:
        ok = d_v == 512 and gqa_opt
    else:
        ok = False
    if not ok or k.type not in FATTN_KV_TYPES or v.type not in FATTN_KV_TYPES:
        return False
    return mask is None or mask.ne[2] == 1


def cuda_fattn_alloc_size(t: Tensor) -> int:
    """The result plus f16 copies of K and V when they are not f16 (the tile and tensor-core kernels read f16).

    A prompt-sized batch always takes those kernels (more than 2 query rows per K/V head on Ada and
    newer, more than 16 on Volta and Turing), so a quantised or f32/bf16 cache is converted, every
    cell of every stream of the layer.
    """
    k, v = t.src[1], t.src[2]
    end = t.nbytes
    if k.type != F16:
        end = _pad(end, 128) + k.nelements * 2
    v_is_k = v.view_src is not None and (v.view_src is k or (v.view_src is k.view_src and v.view_offs == k.view_offs))
    if v.type != F16 and not v_is_k:
        end = _pad(end, 128) + v.nelements * 2
    return end


# ---------------------------------------------------------------- the scheduler's split graph


@dataclass
class _Split:
    backend: int
    i_start: int
    i_end: int = 0
    inputs: list[Tensor] = field(default_factory=list)


class Scheduler:
    """ggml_backend_sched: assign, split, copy and allocate one graph; ``sizes`` is each backend's buffer."""

    def __init__(self, backends: list[Backend], op_offload: bool = True, n_copies: int = 1) -> None:
        self.backends = backends
        self.op_offload = op_offload
        self.n_copies = n_copies
        self.cpu = len(backends) - 1
        self.n_splits = 0

    # -------------------------------------------------- assignment (pass 1 to 4)

    @staticmethod
    def backend_of(t: Tensor | None) -> int:
        """hv_tensor_backend_ids: the backend a tensor is assigned to, -1 for none yet."""
        return -1 if t is None else t.backend

    def pin(self, t: Tensor, backend: int) -> None:
        """ggml_backend_sched_set_tensor_backend (llama_context's graph callback pins layer norms)."""
        if self.backends[backend].supports_op(t):
            t.backend = backend

    def _from_buffer(self, t: Tensor, op: Tensor) -> int:
        buffer = t.view_src.buffer if t.view_src is not None else t.buffer
        if buffer is None:
            return -1
        for b, backend in enumerate(self.backends):
            if backend.supports_buft(buffer.buft) and backend.supports_op(op):
                return b
        return -1

    def _from_cur(self, t: Tensor) -> int:
        b = self._from_buffer(t, t)
        if b != -1:
            return b
        if t.view_src is not None:
            b = self._from_buffer(t.view_src, t)
            if b != -1:
                return b
        if t.flags & INPUT:
            return self.cpu
        if t.op in ("ROPE", "FLASH_ATTN_EXT"):
            return -1
        for src in t.src:
            if src is None or src.buffer is None or not src.buffer.weights:
                continue
            b = self._from_buffer(src, t)
            if self.op_offload and b == self.cpu and src.buffer.buft.host:
                for g in range(b):
                    if self.backends[g].supports_op(t) and self.backends[g].offload_op(t):
                        return g
            return b
        return -1

    def _buffer_supported(self, t: Tensor, b: int) -> bool:
        buffer = t.view_src.buffer if t.view_src is not None else t.buffer
        if buffer is not None:
            buft = buffer.buft
        else:
            owner = self.backend_of(t)
            if owner == -1 and t.view_src is not None:
                owner = self.backend_of(t.view_src)
            if owner == -1:
                return False
            buft = self.backends[owner].buft
        return self.backends[b].supports_buft(buft)

    def _set_if_supported(self, node: Tensor, b: int) -> None:
        if self.backends[b].supports_op(node):
            node.backend = b

    def _expand(self, nodes: list[Tensor], skip_cpu: bool) -> None:
        cur = -1
        for node in nodes:
            if node.op in VIEW_OPS:
                continue
            b = node.backend
            if b != -1:
                cur = -1 if skip_cpu and b == self.cpu else b
            elif cur != -1:
                self._set_if_supported(node, cur)

    def assign(self, graph: Graph) -> None:
        for leaf in graph.leafs:
            if leaf.backend == -1:
                leaf.backend = self._from_cur(leaf)
        for node in graph.nodes:
            if node.backend == -1:
                node.backend = self._from_cur(node)
        # pass 2: spread GPU assignments down and up, then any assignment down and up
        self._expand(graph.nodes, True)
        self._expand(graph.nodes[::-1], True)
        self._expand(graph.nodes, False)
        self._expand(graph.nodes[::-1], False)
        # pass 3: unassigned nodes go where most of their inputs can be read; assigned ones move up a priority
        # where the buffer type is the same (never between a GPU and the host here)
        for node in graph.nodes:
            if node.op in VIEW_OPS:
                continue
            if node.backend == -1:
                best = -1
                for b, backend in enumerate(self.backends):
                    if not backend.supports_op(node):
                        continue
                    n = sum(1 for src in node.src if src is not None
                            and (self.backend_of(src) != -1 or self.backend_of(src.view_src) != -1)
                            and self._buffer_supported(src, b))
                    if n > best:
                        best = n
                        node.backend = b
        # pass 4: views follow their source, unassigned sources follow their consumer
        for node in graph.nodes:
            if node.view_src is not None and node.backend == -1:
                node.backend = node.view_src.backend
            for src in node.src:
                if src is None or src.backend != -1:
                    continue
                src.backend = src.view_src.backend if src.view_src is not None else node.backend
            if node.backend == -1:
                for b in range(len(self.backends)):
                    self._set_if_supported(node, b)
                    if node.backend != -1:
                        break

    # -------------------------------------------------- splits and copies (pass 5, 6)

    def split(self, graph: Graph) -> tuple[list[_Split], dict[tuple[int, int], list[Tensor]]]:
        nodes = graph.nodes
        copies: dict[tuple[int, int], list[Tensor]] = {}
        splits: list[_Split] = []
        first = next((i for i, n in enumerate(nodes) if n.op not in VIEW_OPS), len(nodes))
        split = _Split(nodes[first].backend if first < len(nodes) else self.cpu, 0)
        splits.append(split)
        cur = split.backend
        for i in range(first, len(nodes)):
            node = nodes[i]
            if node.op in VIEW_OPS:
                continue
            b = node.backend
            new_split = False
            if b == cur and split.inputs:
                for src in node.src:
                    if src is not None and src.buffer is not None and src.buffer.weights:
                        if self.backend_of(src) != cur and not self._buffer_supported(src, cur):
                            new_split = True
                            break
            if b != cur or new_split:
                split.i_end = i
                split = _Split(b, i)
                splits.append(split)
                cur = b
            for j, src in enumerate(node.src):
                if src is None:
                    continue
                if self.backend_of(src) != cur and not self._buffer_supported(src, cur):
                    key = (id(src), cur)
                    if key not in copies:
                        made = []
                        for c in range(self.n_copies):
                            copy = dup_tensor_layout(src, f"{self.backends[cur].name}#{src.name}#{c}")
                            if self.n_copies > 1:
                                copy.flags |= INPUT | OUTPUT
                            copy.backend = cur
                            made.append(copy)
                        copies[key] = made
                        split.inputs.append(src)
                    node.src[j] = copies[key][0]
        split.i_end = len(nodes)
        self.n_splits = len(splits)
        return splits, copies

    def _alloc_deps(self, split: _Split, nodes: list[Tensor]) -> dict[int, list[Tensor]]:
        """Tensors a backend keeps alive until a later node of the split (ggml_backend_cuda_graph_optimize)."""
        deps: dict[int, list[Tensor]] = {}
        if not self.backends[split.backend].gpu:
            return deps
        part = nodes[split.i_start:split.i_end]
        for i in range(len(part)):
            match = _moe_weighted_reduction(part, i)
            if match is not None:
                experts, weights, dst = match
                keep = deps.setdefault(id(dst), [])
                for t in (experts, weights):
                    if all(k is not t for k in keep):
                        keep.append(t)
        return deps

    # -------------------------------------------------- allocation

    def reserve(self, graph: Graph) -> list[int]:
        """Assign, split and allocate: the compute buffer of each backend, in bytes."""
        self.assign(graph)
        splits, copies = self.split(graph)
        order: list[tuple[Tensor, int]] = []
        for split in splits:
            deps = self._alloc_deps(split, graph.nodes)
            for src in split.inputs:
                dep = view_tensor(src)
                dep.src = [src]
                order.append((dep, self.backend_of(src)))
                order.append((copies[(id(src), split.backend)][0], split.backend))
            for node in graph.nodes[split.i_start:split.i_end]:
                order.append((node, node.backend))
                for k in range(0, len(deps.get(id(node), [])), 10):
                    keep = deps[id(node)][k:k + 10]
                    dep = view_tensor(keep[0])
                    dep.src = list(keep)
                    order.append((dep, split.backend))
        leafs: list[tuple[Tensor, int]] = []
        if self.n_copies > 1:
            # pass 6: every graph input gets a copy per pipeline stage, kept for the whole graph, and so does every
            # split input; they are leafs, allocated before anything else
            for leaf in graph.leafs:
                if leaf.flags & INPUT:
                    leaf.flags |= OUTPUT
                    leafs.append((leaf, leaf.backend))
                    for c in range(1, self.n_copies):
                        copy = dup_tensor_layout(leaf, f"{leaf.name}#{c}")
                        copy.flags |= INPUT | OUTPUT
                        copy.backend = leaf.backend
                        leafs.append((copy, leaf.backend))
            for (_src, backend), made in copies.items():
                leafs += [(copy, backend) for copy in made]
        leafs += [(leaf, leaf.backend) for leaf in graph.leafs]
        return _Allocator(self.backends).run(leafs, order)


def _moe_weighted_reduction(nodes: list[Tensor], i: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """ggml_cuda_match_moe_weighted_reduction: experts * weights, then views of it summed by a chain of adds."""
    first = nodes[i]
    if first.op != "MUL" or first.type != 0 or not first.is_contiguous():
        return None
    a, b = first.src[0], first.src[1]

    def is_experts(t: Tensor | None) -> bool:
        return t is not None and t.type == 0 and t.is_contiguous() and t.ne == first.ne

    def is_weights(t: Tensor | None) -> bool:
        return (t is not None and t.type == 0 and t.is_contiguous() and t.ne[0] == 1
                and t.ne[1:] == first.ne[1:])

    if is_experts(a) and is_weights(b):
        experts, weights = a, b
    elif is_experts(b) and is_weights(a):
        experts, weights = b, a
    else:
        return None
    n_used = first.ne[1]
    if not 2 <= n_used <= 15:
        return None
    count = 2 * n_used
    if i + count > len(nodes):
        return None
    tail = nodes[i + 1:i + count]
    views = [t for t in tail[:n_used]]
    adds = tail[n_used:]
    if any(t.op != "VIEW" or t.view_src is not first for t in views) or any(t.op != "ADD" for t in adds):
        return None
    return experts, weights, adds[-1]


class _Dyn:
    """ggml_dyn_tallocr with one chunk: free blocks sorted by offset, best fit, the last block grows."""

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.blocks: list[list[int]] = [[0, 1 << 62]]
        self.max_size = 0

    def alloc(self, size: int) -> int:
        size = _pad(size, self.alignment)
        best, best_size = -1, None
        for i in range(len(self.blocks) - 1):
            block_size = self.blocks[i][1]
            if block_size >= size and (best_size is None or block_size <= best_size):
                best, best_size = i, block_size
        if best == -1:
            best = len(self.blocks) - 1
        block = self.blocks[best]
        offset = block[0]
        block[0] += size
        block[1] -= size
        if block[1] == 0:
            del self.blocks[best]
        self.max_size = max(self.max_size, offset + size)
        return offset

    def free(self, offset: int, size: int) -> None:
        size = _pad(size, self.alignment)
        blocks = self.blocks
        for i, block in enumerate(blocks):
            if block[0] + block[1] == offset:
                block[1] += size
                if i < len(blocks) - 1 and block[0] + block[1] == blocks[i + 1][0]:
                    block[1] += blocks[i + 1][1]
                    del blocks[i + 1]
                return
            if offset + size == block[0]:
                block[0] = offset
                block[1] += size
                if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == block[0]:
                    blocks[i - 1][1] += block[1]
                    del blocks[i]
                return
        pos = 0
        while pos < len(blocks) and blocks[pos][0] < offset:
            pos += 1
        blocks.insert(pos, [offset, size])


class _Allocator:
    """ggml_gallocr_alloc_graph_impl over the scheduler's graph copy (its hash table lives on the tensors)."""

    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends
        self.dyn = [_Dyn(b.alignment) for b in backends]
        self._sizes: dict[tuple[int, int], int] = {}

    def _size(self, t: Tensor, buffer: int) -> int:
        key = (id(t), buffer)
        size = self._sizes.get(key)
        if size is None:
            size = self._sizes[key] = self.backends[buffer].alloc_size(t)
        return size

    def _allocate(self, t: Tensor, buffer: int) -> None:
        if t.buffer is not None or t.allocated or t.view_src is not None:
            return
        t.allocated = True
        if t.op in INPLACE_OPS:
            for parent in t.src:
                if parent is None or not parent.allocated:
                    continue
                if parent.flags & OUTPUT or not t.same_layout(parent):
                    continue
                if parent.n_children == 1 and parent.n_views == 0:
                    t.buf_id, t.offset = parent.buf_id, parent.offset
                    parent.allocated = False
                    align = self.dyn[parent.buf_id].alignment
                    mine = _pad(self._size(t, t.buf_id), align)
                    extra = _pad(self._size(parent, parent.buf_id), align) - mine
                    if extra > 0:
                        self.dyn[parent.buf_id].free(parent.offset + mine, extra)
                    return
        t.buf_id = buffer
        t.offset = self.dyn[buffer].alloc(self._size(t, buffer))

    def _free(self, t: Tensor) -> None:
        if t.flags & OUTPUT:
            return
        self.dyn[t.buf_id].free(t.offset, self._size(t, t.buf_id))
        t.allocated = False

    def run(self, leafs: list[tuple[Tensor, int]], order: list[tuple[Tensor, int]]) -> list[int]:
        for leaf, buffer in leafs:
            if buffer >= 0:
                self._allocate(leaf, buffer)
        for node, buffer in order:
            if node.view_src is not None and node.op != "NONE":
                node.view_src.n_views += 1
            if node.flags & INPUT:
                self._allocate(node, buffer)
            for src in node.src:
                if src is None:
                    continue
                src.n_children += 1
                if src.flags & INPUT:
                    self._allocate(src, buffer)
        allocate, free = self._allocate, self._free
        for node, buffer in order:
            for parent in node.src:
                if parent is not None:
                    allocate(parent, buffer)
            allocate(node, buffer)
            for parent in node.src:
                if parent is None:
                    continue
                parent.n_children -= 1
                if parent.n_children == 0 and parent.n_views == 0:
                    root = parent.view_src
                    if root is not None:
                        root.n_views -= 1
                        if root.n_views == 0 and root.n_children == 0 and root.allocated:
                            free(root)
                    elif parent.allocated:
                        free(parent)
        return [d.max_size for d in self.dyn]
