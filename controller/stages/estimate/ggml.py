"""A symbolic ggml: tensors with types, shapes and strides, the ops llama.cpp's graphs use, and graph building.

Nothing is computed. What the memory of a compute graph depends on is mirrored from ggml/src/ggml.c at
llama.cpp 0c1e570 (the pinned upstream engine):

* the type, shape and strides of every result (``ggml_new_tensor_impl``, ``ggml_view_impl``,
  ``ggml_permute``, ``ggml_transpose``, ``ggml_mul_mat``, ``ggml_flash_attn_ext``, ...);
* which results are views of another tensor and own no memory (a non-NULL ``view_src``: reshapes,
  views, permutes, ``ggml_set_rows`` into the KV cache), always pointing at the root tensor;
* the order in which ``ggml_build_forward_expand`` adds nodes and leafs (``ggml_visit_parents_graph``:
  sources left to right, depth first, each tensor once).

``controller.stages.estimate.sched`` places and allocates such a graph the way the engine's scheduler does.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
F32, F16, BF16, I32, I64 = T.F32, T.F16, T.BF16, T.I32, T.I64

INPUT, OUTPUT = 1, 2  # GGML_TENSOR_FLAG_INPUT / GGML_TENSOR_FLAG_OUTPUT
VIEW_OPS = frozenset({"VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"})  # ggml-backend.cpp ggml_is_view_op


_SIZES = {int(qtype): sizes for qtype, sizes in GGML_QUANT_SIZES.items()}  # type -> (block, bytes per block)


def type_size(qtype: int) -> int:
    return _SIZES[qtype][1]


def blck_size(qtype: int) -> int:
    return _SIZES[qtype][0]


def row_size(qtype: int, n: int) -> int:
    block, size = _SIZES[qtype]
    return size * n // block


def is_quantized(qtype: int) -> bool:
    return _SIZES[qtype][0] > 1


@dataclass(frozen=True)
class BufferType:
    """A buffer type as the scheduler compares them: by name, and whether the CPU can read it in place."""

    name: str
    host: bool


@dataclass(frozen=True)
class Buffer:
    """A pre-allocated buffer (model weights or the KV cache): the tensors in it are never allocated by the graph."""

    buft: BufferType
    weights: bool  # GGML_BACKEND_BUFFER_USAGE_WEIGHTS


class Tensor:
    __slots__ = ("name", "type", "ne", "nb", "op", "src", "view_src", "view_offs", "flags", "buffer",
                 # the scheduler's and the allocator's state for this tensor (every graph is built afresh)
                 "backend", "n_children", "n_views", "buf_id", "offset", "allocated")

    def __init__(self, qtype: int, ne: list[int], view_src: Tensor | None = None, view_offs: int = 0,
                 name: str = "") -> None:
        ne = list(ne) + [1] * (4 - len(ne))
        if view_src is not None and view_src.view_src is not None:
            view_offs += view_src.view_offs
            view_src = view_src.view_src
        qtype = int(qtype)
        bs, ts = _SIZES[qtype]
        nb = [ts, ts * (ne[0] // bs), 0, 0]
        nb[2] = nb[1] * ne[1]
        nb[3] = nb[2] * ne[2]
        self.name = name
        self.type = qtype
        self.ne = ne
        self.nb = nb
        self.op = "NONE"
        self.src: list[Tensor | None] = []
        self.view_src = view_src
        self.view_offs = view_offs
        self.flags = 0
        self.buffer: Buffer | None = None
        self.backend = -1
        self.n_children = 0
        self.n_views = 0
        self.buf_id = -1
        self.offset = 0
        self.allocated = False

    def __repr__(self) -> str:
        return f"<{self.op} {self.name} {T(self.type).name} {self.ne}>"

    @property
    def nbytes(self) -> int:
        """ggml_nbytes: the span the strides cover (a permuted or strided view can cover more than its elements)."""
        ne, nb = self.ne, self.nb
        if ne[0] <= 0 or ne[1] <= 0 or ne[2] <= 0 or ne[3] <= 0:
            return 0
        bs, ts = _SIZES[self.type]
        if bs == 1:
            return ts + (ne[0] - 1) * nb[0] + (ne[1] - 1) * nb[1] + (ne[2] - 1) * nb[2] + (ne[3] - 1) * nb[3]
        size = self.ne[0] * self.nb[0] // bs
        for i in range(1, 4):
            size += (self.ne[i] - 1) * self.nb[i]
        return size

    @property
    def nelements(self) -> int:
        return self.ne[0] * self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def nrows(self) -> int:
        return self.ne[1] * self.ne[2] * self.ne[3]

    def is_contiguous(self, n: int = 0) -> bool:
        """ggml_is_contiguous_n."""
        next_nb = type_size(self.type)
        if self.ne[0] != blck_size(self.type) and self.nb[0] != next_nb:
            return False
        next_nb *= self.ne[0] // blck_size(self.type)
        for i in range(1, 4):
            if self.ne[i] != 1:
                if i > n:
                    if self.nb[i] != next_nb:
                        return False
                    next_nb *= self.ne[i]
                else:
                    next_nb = self.ne[i] * self.nb[i]
        return True

    def same_layout(self, other: Tensor) -> bool:
        return self.type == other.type and self.ne == other.ne and self.nb == other.nb


def _op(result: Tensor, op: str, *src: Tensor | None) -> Tensor:
    result.op = op
    result.src = list(src)
    return result


# ---------------------------------------------------------------- constructors (ggml.c)


def new_tensor(qtype: int, *ne: int, name: str = "") -> Tensor:
    return Tensor(qtype, list(ne), name=name)


def dup_tensor(a: Tensor) -> Tensor:
    return Tensor(a.type, a.ne)


def view_tensor(a: Tensor) -> Tensor:
    """ggml_view_tensor: same shape and strides, no memory of its own."""
    result = Tensor(a.type, a.ne, view_src=a, view_offs=0)
    result.nb = list(a.nb)
    return result


def dup_tensor_layout(a: Tensor, name: str = "") -> Tensor:
    """ggml_dup_tensor_layout: a new tensor with the shape and the strides of ``a`` (the scheduler's input copies)."""
    result = Tensor(a.type, a.ne, name=name)
    result.nb = list(a.nb)
    return result


def reshape(a: Tensor, *ne: int) -> Tensor:
    return _op(Tensor(a.type, list(ne), view_src=a, view_offs=0), "RESHAPE", a)


def view(a: Tensor, ne: list[int], nb: list[int], offset: int) -> Tensor:
    """ggml_view_2d/3d/4d: ``nb`` holds nb1.. of the view; the higher strides follow from them."""
    result = Tensor(a.type, ne, view_src=a, view_offs=offset)
    strides = [result.nb[0]] + list(nb)
    while len(strides) < 4:
        strides.append(strides[-1] * result.ne[len(strides) - 1])
    result.nb = strides
    return _op(result, "VIEW", a)


def permute(a: Tensor, ax0: int, ax1: int, ax2: int, ax3: int) -> Tensor:
    result = view_tensor(a)
    ne, nb = [0] * 4, [0] * 4
    for src_axis, dst_axis in enumerate((ax0, ax1, ax2, ax3)):
        ne[dst_axis] = a.ne[src_axis]
        nb[dst_axis] = a.nb[src_axis]
    result.ne, result.nb = ne, nb
    return _op(result, "PERMUTE", a)


def transpose(a: Tensor) -> Tensor:
    result = view_tensor(a)
    result.ne = [a.ne[1], a.ne[0], a.ne[2], a.ne[3]]
    result.nb = [a.nb[1], a.nb[0], a.nb[2], a.nb[3]]
    return _op(result, "TRANSPOSE", a)


def cont(a: Tensor) -> Tensor:
    return _op(dup_tensor(a), "CONT", a)


def cont_2d(a: Tensor, ne0: int, ne1: int) -> Tensor:
    return _op(Tensor(a.type, [ne0, ne1]), "CONT", a)


def unary(op: str, a: Tensor) -> Tensor:
    """RMS_NORM, SCALE, CLAMP, SOFT_MAX, UNARY (silu, gelu, tanh), SQRT: a new tensor shaped like ``a``."""
    return _op(dup_tensor(a), op, a)


def binary(op: str, a: Tensor, b: Tensor) -> Tensor:
    """ADD, MUL, DIV: a new tensor shaped like ``a`` (``b`` broadcasts)."""
    return _op(dup_tensor(a), op, a, b)


def mul_mat(a: Tensor, b: Tensor) -> Tensor:
    return _op(Tensor(F32, [a.ne[1], b.ne[1], b.ne[2], b.ne[3]]), "MUL_MAT", a, b)


def mul_mat_id(a: Tensor, b: Tensor, ids: Tensor) -> Tensor:
    return _op(Tensor(F32, [a.ne[1], ids.ne[0], b.ne[2], 1]), "MUL_MAT_ID", a, b, ids)


def get_rows(a: Tensor, b: Tensor) -> Tensor:
    qtype = I32 if a.type == I32 else F32
    return _op(Tensor(qtype, [a.ne[0], b.ne[0], b.ne[1], b.ne[2]]), "GET_ROWS", a, b)


def rope(a: Tensor, pos: Tensor, factors: Tensor | None = None) -> Tensor:
    return _op(dup_tensor(a), "ROPE", a, pos, factors)


def flash_attn_ext(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    return _op(Tensor(F32, [v.ne[0], q.ne[2], q.ne[1], q.ne[3]]), "FLASH_ATTN_EXT", q, k, v, mask)


def soft_max_ext(a: Tensor, mask: Tensor | None) -> Tensor:
    return _op(dup_tensor(a), "SOFT_MAX", a, mask)


def set_rows(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """ggml_set_rows: writes ``b`` into rows ``c`` of ``a``; the result is a view of ``a`` (src order b, c, a)."""
    return _op(view_tensor(a), "SET_ROWS", b, c, a)


def glu_split(a: Tensor, b: Tensor) -> Tensor:
    """ggml_swiglu_split / ggml_geglu_split: act(a) * b, shaped like ``a``."""
    return _op(Tensor(a.type, a.ne), "GLU", a, b)


def argsort_top_k(a: Tensor, k: int) -> Tensor:
    result = _op(Tensor(I32, a.ne), "ARGSORT", a)
    return view(result, [k, result.ne[1], result.ne[2], result.ne[3]], result.nb[1:], 0)


def sum_rows(a: Tensor) -> Tensor:
    return _op(Tensor(a.type, [1, a.ne[1], a.ne[2], a.ne[3]]), "SUM_ROWS", a)


def cast(a: Tensor, qtype: int) -> Tensor:
    result = Tensor(qtype, a.ne)
    return _op(result, "CPY", a, result)


def set_input(t: Tensor, name: str) -> Tensor:
    t.flags |= INPUT
    t.name = name
    return t


# ---------------------------------------------------------------- graph


class Graph:
    """Nodes and leafs in the order ``ggml_build_forward_expand`` adds them."""

    def __init__(self) -> None:
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        self._visited: set[int] = set()

    def expand(self, root: Tensor) -> Tensor:
        """ggml_visit_parents_graph without recursion (a deep graph would overflow Python's stack)."""
        if id(root) in self._visited:
            return root
        self._visited.add(id(root))
        stack: list[list] = [[root, 0]]
        while stack:
            frame = stack[-1]
            tensor, i = frame
            pushed = False
            while i < len(tensor.src):
                source = tensor.src[i]
                i += 1
                if source is not None and id(source) not in self._visited:
                    self._visited.add(id(source))
                    frame[1] = i
                    stack.append([source, 0])
                    pushed = True
                    break
            if pushed:
                continue
            stack.pop()
            (self.leafs if tensor.op == "NONE" else self.nodes).append(tensor)
        return root
