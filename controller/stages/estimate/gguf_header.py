"""Read only the header of a GGUF (metadata and tensor infos), from a local file or an http(s) URL.

Planning must not download tens of GB to learn a model's shape, and ``gguf.GGUFReader`` maps the
whole file and builds every tensor array, so it cannot open a header-only or truncated file. This
reader walks the header with gguf-py's constants and block-size table and asks its byte source for
more only when it runs out: a local file is read in growing chunks; a URL is fetched with growing
HTTP Range requests (a server that ignores Range is read as a stream and closed as soon as the
header is complete). Tensor data is never read.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from controller.errors import ControllerError

_FIRST_CHUNK = 64 << 10  # most headers fit; big vocabularies take a few doubling reads
_MAX_STEP = 8 << 20  # cap on one read-ahead, so a read never runs far past the header into tensor data
_MAX_HEADER = 1 << 30  # a vocabulary of a few million tokens is still far below this
_MAX_ARRAY = 1 << 24  # items in one metadata array: vocabularies and merge lists stay far below this
_MAX_NESTING = 4  # arrays of arrays: real headers nest at most once
_MAGIC_BYTES = struct.pack("<I", GGUF_MAGIC)

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT32: "f", GGUFValueType.FLOAT64: "d",
    GGUFValueType.BOOL: "?",
}


class GGUFHeaderError(ControllerError):
    """The model source is not a readable GGUF: wrong magic, a truncated header, or an unreachable URL."""

    exit_code = 2


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it; ``shape`` is in ggml order (row length first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type{self.ggml_type}"


@dataclass
class GGUFHeader:
    """Everything before the tensor data: version, metadata key/values and tensor infos."""

    source: str
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int
    file_size: int | None = None
    unknown_types: set[int] = field(default_factory=set)

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, suffix: str, default: Any = None) -> Any:
        """The architecture-scoped key (``<arch>.<suffix>``), as llama.cpp looks keys up."""
        return self.metadata.get(f"{self.arch}.{suffix}", default)

    def arch_int(self, suffix: str, default: int = 0) -> int:
        """An architecture-scoped key that must be one number; GGUFHeaderError names it when it is not."""
        value = self.arch_value(suffix)
        return default if value is None else number(value, f"{self.arch}.{suffix}", self.source)

    def arch_ints(self, suffix: str) -> int | list[int] | None:
        """A key that is one number or one number per layer (head counts, n_ff), checked like ``arch_int``."""
        value = self.arch_value(suffix)
        if isinstance(value, list):
            return [number(item, f"{self.arch}.{suffix}", self.source) for item in value]
        return None if value is None else number(value, f"{self.arch}.{suffix}", self.source)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def has_tensor_data(self) -> bool:
        """Whether the file (as far as its size is known) holds all the tensor data, not just the header."""
        if self.file_size is None:
            return False
        end = max((t.offset + t.nbytes for t in self.tensors), default=0)
        return self.file_size >= self.data_offset + end


class _ByteSource(Protocol):
    """Sequential reader: each call continues where the previous one stopped."""

    size: int | None

    def fetch(self, start: int, end: int) -> bytes: ...

    def close(self) -> None: ...


class _FileSource:
    def __init__(self, path: Path) -> None:
        try:
            self._handle = open(path, "rb")  # noqa: SIM115 - closed by close()
        except OSError as exc:
            raise GGUFHeaderError(f"cannot open {path}: {exc.strerror}; check the model path") from exc
        self.size: int | None = os.fstat(self._handle.fileno()).st_size

    def fetch(self, start: int, end: int) -> bytes:
        self._handle.seek(start)
        return self._handle.read(end - start)

    def close(self) -> None:
        self._handle.close()


_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


class _HttpSource:
    """Range reads over HTTP; falls back to a streamed body (closed early) if Range is ignored."""

    def __init__(self, url: str, headers: Mapping[str, str] | None, timeout: float) -> None:
        self.url = url
        self.size: int | None = None
        self._client = httpx.Client(follow_redirects=True, timeout=timeout, headers=dict(headers or {}))
        self._stream: httpx.Response | None = None
        self._stream_iter: Any = None
        self._pending = b""

    def fetch(self, start: int, end: int) -> bytes:
        if self._stream is not None:
            return self._read_stream(end - start)
        request = self._client.build_request("GET", self.url, headers={"Range": f"bytes={start}-{end - 1}"})
        try:
            response = self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise GGUFHeaderError(f"cannot read {self.url}: {exc}; check the URL and the network") from exc
        if response.status_code == 206:
            try:
                body = response.read()
            finally:
                response.close()
            self._note_size(response)
            return body[: end - start]
        if response.status_code == 416:
            response.close()
            return b""
        if response.status_code == 200 and start == 0:
            # The server ignored Range: read the body as a stream and stop as soon as the header is parsed.
            length = response.headers.get("content-length")
            self.size = int(length) if length and length.isdigit() else None
            self._stream, self._stream_iter = response, response.iter_bytes()
            return self._read_stream(end - start)
        response.close()
        hint = " (set an auth header for gated models)" if response.status_code in (401, 403) else ""
        raise GGUFHeaderError(f"cannot read {self.url}: HTTP {response.status_code}{hint}")

    def _note_size(self, response: httpx.Response) -> None:
        match = _CONTENT_RANGE.search(response.headers.get("content-range", ""))
        if match and match.group(3) != "*":
            self.size = int(match.group(3))

    def _read_stream(self, count: int) -> bytes:
        chunks = [self._pending]
        have = len(self._pending)
        try:
            while have < count:
                chunk = next(self._stream_iter, b"")
                if not chunk:
                    break
                chunks.append(chunk)
                have += len(chunk)
        except httpx.HTTPError as exc:
            raise GGUFHeaderError(f"cannot read {self.url}: {exc}") from exc
        data = b"".join(chunks)
        self._pending = data[count:]
        return data[:count]

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._client.close()


class _Cursor:
    """Position in a growing buffer; asks the source for more (doubling) when a read runs past its end."""

    def __init__(self, source: _ByteSource, label: str) -> None:
        self.source = source
        self.label = label
        self.buf = bytearray()
        self.pos = 0
        self.endian = "<"
        self._exhausted = False

    def need(self, count: int) -> None:
        want = self.pos + count
        while len(self.buf) < want:
            if self._exhausted:
                raise GGUFHeaderError(
                    f"{self.label}: the GGUF header is truncated (it needs more than {len(self.buf)} bytes, "
                    "the file ends there); re-download the model"
                )
            target = max(want, min(len(self.buf) * 2, len(self.buf) + _MAX_STEP), _FIRST_CHUNK)
            if target > _MAX_HEADER:
                raise GGUFHeaderError(f"{self.label}: GGUF header larger than {_MAX_HEADER >> 20} MiB; the file is corrupt")
            data = self.source.fetch(len(self.buf), target)
            if len(data) < target - len(self.buf):
                self._exhausted = True
            self.buf += data

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        full = self.endian + fmt
        size = struct.calcsize(full)
        self.need(size)
        values = struct.unpack_from(full, self.buf, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        if length > _MAX_HEADER:
            raise GGUFHeaderError(f"{self.label}: string length {length} at byte {self.pos - 8}; the header is corrupt")
        self.need(length)
        raw = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str = "", depth: int = 0) -> Any:
        try:
            kind = GGUFValueType(vtype)
        except ValueError:
            raise GGUFHeaderError(f"{self.label}: unknown metadata value type {vtype} for {key!r}; the header is "
                                  "corrupt") from None
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item_type, count = self.unpack("IQ")
            if count > _MAX_ARRAY or depth >= _MAX_NESTING:
                what = f"{count} items" if count > _MAX_ARRAY else f"arrays nested {depth + 1} deep"
                raise GGUFHeaderError(f"{self.label}: metadata key {key!r} holds {what}; the header is corrupt "
                                      "(re-download the model)")
            if item_type in _SCALAR_FORMATS:
                return list(self.unpack(f"{count}{_SCALAR_FORMATS[GGUFValueType(item_type)]}")) if count else []
            return [self.value(item_type, key, depth + 1) for _ in range(count)]
        return self.unpack(_SCALAR_FORMATS[kind])[0]


def number(value: Any, key: str, label: str) -> int:
    """A metadata value that must be a whole number; anything else means a corrupt or hand-made header."""
    if not isinstance(value, (int, float)) or value != value or value in (float("inf"), float("-inf")):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise GGUFHeaderError(f"{label}: metadata key {key!r} is {shown}, where a number belongs; the header is "
                              "corrupt (re-download or re-convert the model)")
    return int(value)


def _alignment(value: Any, label: str) -> int:
    alignment = number(value, "general.alignment", label) or GGUF_DEFAULT_ALIGNMENT
    if alignment < 0 or alignment & (alignment - 1):
        raise GGUFHeaderError(f"{label}: metadata key 'general.alignment' is {alignment}, not a power of two; "
                              "the header is corrupt (re-download or re-convert the model)")
    return alignment


def _open_source(source: str | Path, headers: Mapping[str, str] | None, timeout: float) -> _ByteSource:
    text = str(source)
    if text.startswith(("http://", "https://")):
        return _HttpSource(text, headers, timeout)
    if "://" in text:
        raise GGUFHeaderError(f"{text}: only local paths and http(s) URLs can be read")
    return _FileSource(Path(text))


def _parse_preamble(cur: _Cursor) -> tuple[int, int, int]:
    cur.need(4)
    magic = bytes(cur.buf[:4])
    if magic != _MAGIC_BYTES:
        raise GGUFHeaderError(
            f"{cur.label}: not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
            "point it at the .gguf file itself (for a hub, the raw/resolve URL, not the web page)"
        )
    cur.pos = 4
    (version,) = cur.unpack("I")
    if version & 0xFFFF == 0 and version != 0:
        cur.endian = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version < 2:
        raise GGUFHeaderError(f"{cur.label}: GGUF version {version} is too old to read; convert the model again")
    n_tensors, n_kv = cur.unpack("QQ")
    if n_tensors > 10_000_000 or n_kv > 10_000_000:
        raise GGUFHeaderError(f"{cur.label}: implausible counts ({n_tensors} tensors, {n_kv} keys); the header is corrupt")
    return version, n_tensors, n_kv


def _tensor_nbytes(shape: tuple[int, ...], ggml_type: int) -> int | None:
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None
    count = 1
    for dim in shape:
        count *= dim
    return count // block * type_size


def _infer_sizes(raw: list[tuple[str, tuple[int, ...], int, int, int | None]], data_end: int | None) -> list[TensorInfo]:
    """Fill sizes of tensor types gguf-py does not know (e.g. ik_llama.cpp's) from the next tensor's offset."""
    by_offset = sorted(range(len(raw)), key=lambda i: raw[i][3])
    next_offset: dict[int, int | None] = {}
    for rank, index in enumerate(by_offset):
        nxt = raw[by_offset[rank + 1]][3] if rank + 1 < len(by_offset) else data_end
        next_offset[index] = nxt
    tensors = []
    for index, (name, shape, ggml_type, offset, nbytes) in enumerate(raw):
        if nbytes is None:
            nxt = next_offset[index]
            nbytes = max(nxt - offset, 0) if nxt is not None else 0
        tensors.append(TensorInfo(name, shape, ggml_type, offset, nbytes))
    return tensors


def read_header(
    source: str | Path, *, headers: Mapping[str, str] | None = None, timeout: float = 30.0
) -> GGUFHeader:
    """Read the GGUF header of a local path or http(s) URL without touching tensor data.

    Raises GGUFHeaderError for a missing file, an unreachable URL, a file that is not a GGUF, or
    a header cut short; a file whose tensor data is missing or short is fine.
    """
    label = str(source)
    byte_source = _open_source(source, headers, timeout)
    try:
        cur = _Cursor(byte_source, label)
        version, n_tensors, n_kv = _parse_preamble(cur)
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            (vtype,) = cur.unpack("I")
            metadata[key] = cur.value(vtype, key)
        raw = []
        unknown: set[int] = set()
        for _ in range(n_tensors):
            name = cur.string()
            (n_dims,) = cur.unpack("I")
            if n_dims > 8:
                raise GGUFHeaderError(f"{label}: tensor {name!r} has {n_dims} dimensions; the header is corrupt")
            shape = tuple(cur.unpack(f"{n_dims}Q")) if n_dims else ()
            ggml_type, offset = cur.unpack("IQ")
            nbytes = _tensor_nbytes(shape, ggml_type)
            if nbytes is None:
                unknown.add(ggml_type)
            raw.append((name, shape, ggml_type, offset, nbytes))
        alignment = _alignment(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT), label)
        data_offset = -(-cur.pos // alignment) * alignment
        size = byte_source.size
        data_end = size - data_offset if size is not None and size > data_offset else None
        return GGUFHeader(
            source=label, version=version, metadata=metadata, tensors=_infer_sizes(raw, data_end),
            alignment=alignment, data_offset=data_offset, file_size=size, unknown_types=unknown,
        )
    finally:
        byte_source.close()
