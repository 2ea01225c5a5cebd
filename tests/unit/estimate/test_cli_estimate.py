"""``controller estimate`` keeps its JSON contract and turns bad input into one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.fileserver import FileServer
from lab.tinymodels import write_gguf, write_model
from tests.cli import invoke

CONTRACT = {
    "model": {"arch", "n_layer", "n_ctx_train", "params", "file_type", "size_bytes"},
    "weights": {"total_mib", "per_device"},
    "kv": {"total_mib", "cells", "swa_cells", "layers", "swa_layers", "bytes_per_token"},
    "compute": {"total_mib", "per_device"},
}
DEVICE_KEYS = {"name", "weights_mib", "kv_mib", "compute_mib", "total_mib"}


def run(*args: str) -> tuple[int, str]:
    result = invoke("estimate", *args)
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("m") / "g.gguf", "gemma3", n_layer=4, file_type="q8_0")


def test_json_has_every_contract_field(gemma: Path) -> None:
    code, out = run(str(gemma), "--ctx", "4096", "--parallel", "2", "--cache-type-k", "q8_0", "--json")
    assert code == 0, out
    data = json.loads(out)
    for section, keys in CONTRACT.items():
        assert keys <= set(data[section]), section
    assert {d["name"] for d in data["devices"]} == {"CPU"}
    assert all(DEVICE_KEYS <= set(d) for d in data["devices"])
    assert data["model"]["arch"] == "gemma3" and data["model"]["file_type"] == "Q8_0"
    assert data["kv"]["swa_layers"] == 2 and data["kv"]["cells"] == 2048  # 4096 / 2 slots, not unified
    assert data["total_mib"] == pytest.approx(sum(d["total_mib"] for d in data["devices"]), abs=0.05)


def test_gpu_options_make_gpu_devices(gemma: Path) -> None:
    code, out = run(str(gemma), "--gpus", "0,1", "--gpu-mem-mib", "16384,16384", "--split-mode", "layer",
                    "--n-gpu-layers", "99", "--flash-attn", "on", "--engine", "upstream", "--ubatch", "1024",
                    "--batch", "2048", "--kv-unified", "--cpu-moe", "--json")
    assert code == 0, out
    devices = {d["name"]: d for d in json.loads(out)["devices"]}
    assert set(devices) == {"CUDA0", "CUDA1", "CPU"}
    assert devices["CUDA0"]["kv_mib"] > 0 and devices["CUDA1"]["kv_mib"] > 0
    assert devices["CUDA0"]["capacity_mib"] == 16384 and devices["CUDA0"]["fits"] is True


def test_text_output_names_devices(gemma: Path) -> None:
    code, out = run(str(gemma), "--ctx", "2048")
    assert code == 0 and "CPU" in out and "SWA" in out


def test_url_reads_the_header_over_http(gemma: Path) -> None:
    with FileServer(gemma.parent) as server:
        code, out = run(f"{server.url}/{gemma.name}", "--json")
        sent = server.bytes_sent
    assert code == 0, out
    assert json.loads(out)["model"]["size_bytes"] == gemma.stat().st_size
    assert sent <= 64 * 1024


def test_url_that_is_not_a_gguf(tmp_path: Path) -> None:
    (tmp_path / "page.gguf").write_text("<html>not found</html>")
    with FileServer(tmp_path) as server:
        code, out = run(f"{server.url}/page.gguf")
    assert code == 2 and "not a GGUF" in out


def test_truncated_header(gemma: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gemma.read_bytes()[:2000])
    code, out = run(str(cut))
    assert code == 2 and "truncated" in out


def test_unknown_catalog_id_is_a_catalog_error() -> None:
    code, out = run("no-such-model-id")
    assert code == 2 and "no-such-model-id" in out


def test_missing_gguf_path() -> None:
    code, out = run("/nonexistent/model.gguf")
    assert code == 2 and "no such file" in out


def test_unknown_architecture_estimates_what_it_can(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "x.gguf", "novelarch", {
        "novelarch.block_count": 2, "novelarch.embedding_length": 128, "novelarch.context_length": 2048,
        "novelarch.attention.head_count": 2}, [], header_only=True)
    code, out = run(str(path), "--json")
    assert code == 0, out
    data = json.loads(out)
    assert data["kv"]["layers"] == 2 and data["kv"]["total_mib"] > 0
    assert any("novelarch" in note for note in data["notes"])


def test_inconsistent_gpu_lists_are_refused(gemma: Path) -> None:
    code, out = run(str(gemma), "--gpus", "0,1", "--gpu-mem-mib", "16384")
    assert code == 2 and "one per GPU" in out
