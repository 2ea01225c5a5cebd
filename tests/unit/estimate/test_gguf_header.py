"""The header reader agrees with gguf-py on full files and also reads what GGUFReader cannot."""

from __future__ import annotations

import http.server
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest

from controller.errors import ControllerError
from controller.stages.estimate.gguf_header import GGUFHeaderError, read_header
from lab.fileserver import FileServer
from lab.tinymodels import write_model
from tests.cli import run_controller
from tests.unit.clean_errors import assert_one_line_error


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "moe": write_model(root / "org" / "repo" / "moe.gguf", "qwen3moe", file_type="q8_0"),
        "gemma": write_model(root / "gemma.gguf", "gemma3", file_type="f16", n_layer=4),
        # ~8 MiB of tensor data behind a ~10 KB header: a remote read must not touch the data
        "big": write_model(root / "big.gguf", "llama", n_layer=4, n_embd=256, n_head=4, n_head_kv=4, n_ff=512,
                           n_vocab=2000, file_type="f32"),
        "head": write_model(root / "head.gguf", "qwen3moe", file_type="q8_0", header_only=True),
    }


def test_full_file_matches_gguf_reader(models: dict[str, Path]) -> None:
    path = models["moe"]
    header = read_header(path)
    reader = gguf.GGUFReader(path)
    assert header.arch == "qwen3moe"
    assert header.version == 3
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors):
        assert ours.shape == tuple(int(x) for x in theirs.shape)
        assert ours.ggml_type == int(theirs.tensor_type)
        assert ours.nbytes == theirs.n_bytes
        assert header.data_offset + ours.offset == theirs.data_offset
    assert header.metadata["qwen3moe.expert_count"] == reader.fields["qwen3moe.expert_count"].contents()
    assert header.metadata["tokenizer.ggml.tokens"] == reader.fields["tokenizer.ggml.tokens"].contents()
    assert header.file_size == path.stat().st_size and header.has_tensor_data


def test_header_only_file_reads_although_gguf_reader_cannot(models: dict[str, Path]) -> None:
    path = models["head"]
    with pytest.raises(Exception):  # noqa: B017 - gguf-py fails in numpy while mapping absent data
        gguf.GGUFReader(path)
    header = read_header(path)
    full = read_header(models["moe"])
    assert [(t.name, t.shape, t.nbytes) for t in header.tensors] == [(t.name, t.shape, t.nbytes) for t in full.tensors]
    assert not header.has_tensor_data


def test_file_truncated_inside_tensor_data_still_reads(models: dict[str, Path], tmp_path: Path) -> None:
    data = models["gemma"].read_bytes()
    header_end = read_header(models["gemma"]).data_offset
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: header_end + 100])
    header = read_header(cut)
    assert len(header.tensors) == len(read_header(models["gemma"]).tensors)
    assert not header.has_tensor_data


def test_file_truncated_inside_the_header_is_a_clear_error(models: dict[str, Path], tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(models["moe"].read_bytes()[:3000])
    with pytest.raises(GGUFHeaderError, match="truncated"):
        read_header(cut)


def test_not_a_gguf_names_what_it_found(tmp_path: Path) -> None:
    page = tmp_path / "model.gguf"
    page.write_text("<!doctype html><html>login</html>")
    with pytest.raises(GGUFHeaderError, match="not a GGUF") as info:
        read_header(page)
    assert isinstance(info.value, ControllerError)


def test_missing_file_and_unsupported_scheme(tmp_path: Path) -> None:
    with pytest.raises(GGUFHeaderError, match="cannot open"):
        read_header(tmp_path / "absent.gguf")
    with pytest.raises(GGUFHeaderError, match="http"):
        read_header("ftp://example.invalid/model.gguf")


# ------------------------------------------------------------------ over HTTP


@pytest.fixture(scope="module")
def hub(models: dict[str, Path]) -> Iterator[FileServer]:
    root = models["gemma"].parent
    with FileServer(root, token="secret") as server:
        yield server


def test_range_reads_fetch_the_header_and_not_the_tensor_data(hub: FileServer, models: dict[str, Path]) -> None:
    hub.reset_counters()
    header = read_header(f"{hub.url}/big.gguf", headers={"Authorization": "Bearer secret"})
    size = models["big"].stat().st_size
    assert header.tensors == read_header(models["big"]).tensors
    assert header.file_size == size  # learned from Content-Range
    assert hub.bytes_sent <= 64 * 1024 < size // 100


def test_hub_redirects_are_followed(hub: FileServer, models: dict[str, Path]) -> None:
    url = f"{hub.url}/redirect/org/repo/moe.gguf"
    header = read_header(url, headers={"Authorization": "Bearer secret"})
    assert header.arch == "qwen3moe"
    assert header.tensors == read_header(models["moe"]).tensors


def test_http_errors_say_what_went_wrong(hub: FileServer) -> None:
    with pytest.raises(GGUFHeaderError, match="HTTP 401.*auth"):
        read_header(f"{hub.url}/big.gguf")
    with pytest.raises(GGUFHeaderError, match="HTTP 404"):
        read_header(f"{hub.url}/nothing.gguf", headers={"Authorization": "Bearer secret"})


def test_unreachable_host_is_a_clear_error() -> None:
    with pytest.raises(GGUFHeaderError, match="cannot read"):
        read_header("http://127.0.0.1:9/model.gguf", timeout=2)


class _NoRangeHandler(http.server.BaseHTTPRequestHandler):
    """A server that ignores Range and answers 200 with the whole body, like some proxies do."""

    body = b""
    sent = 0

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        try:
            for start in range(0, len(self.body), 16384):
                self.wfile.write(self.body[start : start + 16384])
                type(self).sent += 16384
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args: object) -> None:
        pass


def test_server_without_range_support_is_read_as_a_stream_and_closed_early(tmp_path: Path) -> None:
    big = write_model(tmp_path / "huge.gguf", "llama", n_layer=8, n_embd=512, n_head=8, n_head_kv=8, n_ff=1024,
                      n_vocab=4000, file_type="f32")  # ~60 MB
    _NoRangeHandler.body = big.read_bytes()
    _NoRangeHandler.sent = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoRangeHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        header = read_header(f"http://127.0.0.1:{server.server_address[1]}/huge.gguf")
    finally:
        server.shutdown()
        server.server_close()
    assert header.tensors == read_header(big).tensors
    assert header.file_size == len(_NoRangeHandler.body)
    # the client hung up long before the body was through (socket buffers hold a few MB at most)
    assert _NoRangeHandler.sent < len(_NoRangeHandler.body) // 2


def _raw_gguf(path: Path, *entries: bytes) -> Path:
    """A GGUF v3 header of the given metadata entries and no tensors, written byte by byte (corrupt on purpose)."""
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(entries)) + b"".join(entries))
    return path


def _text(value: str) -> bytes:
    return struct.pack("<Q", len(value.encode())) + value.encode()


def _entry(key: str, vtype: gguf.GGUFValueType, payload: bytes) -> bytes:
    return _text(key) + struct.pack("<I", vtype) + payload


ARCH = _entry("general.architecture", gguf.GGUFValueType.STRING, _text("llama"))
ARRAY = gguf.GGUFValueType.ARRAY


@pytest.mark.parametrize("entry,named", [
    # 2**62 eight-byte items: more than any struct can describe
    (_entry("tokenizer.ggml.scores", ARRAY, struct.pack("<IQ", gguf.GGUFValueType.UINT64, 1 << 62)),
     "'tokenizer.ggml.scores' holds 4611686018427387904 items"),
    # arrays nested thousands deep: a recursion without end
    (_entry("tokenizer.ggml.merges", ARRAY, struct.pack("<IQ", ARRAY, 1) * 5000 + struct.pack("<IQ", 4, 0)),
     "'tokenizer.ggml.merges' holds arrays nested"),
    (_entry("general.alignment", gguf.GGUFValueType.STRING, _text("thirty-two")),
     "'general.alignment' is 'thirty-two', where a number belongs"),
    (_entry("general.alignment", gguf.GGUFValueType.UINT32, struct.pack("<I", 24)), "not a power of two"),
    (_entry("llama.block_count", gguf.GGUFValueType.STRING, _text("32")), "'llama.block_count' is '32'"),
    (_entry("llama.block_count", gguf.GGUFValueType.UINT64, struct.pack("<Q", 1 << 60)), "not a layer count"),
    (_entry("llama.attention.head_count", ARRAY, struct.pack("<IQ", gguf.GGUFValueType.STRING, 1) + _text("x")),
     "'llama.attention.head_count' is 'x'"),
], ids=["huge-array", "nested-arrays", "alignment-text", "alignment-24", "block-count-text", "block-count-huge",
        "head-count-text"])
def test_a_corrupt_header_is_one_line_naming_the_file_and_key(tmp_path: Path, entry: bytes, named: str) -> None:
    path = _raw_gguf(tmp_path / "corrupt.gguf", ARCH, entry)
    result = run_controller("estimate", str(path), timeout=120)
    assert_one_line_error(result, 2, str(path), named, "the header is corrupt")
