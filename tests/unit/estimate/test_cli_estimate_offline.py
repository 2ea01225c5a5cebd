"""``controller estimate CATALOG_ID`` without the hub: the catalog's hyperparameters, which ``plan`` uses offline,
stand in for the GGUF header, and the estimate says which of the two it used (issue 21)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.tinymodels import write_model
from tests.cli import invoke

GEMMA = "gemma4-26b-a4b-qat-q4_0"


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub cannot be reached: every HTTP(S) request goes to a proxy on a closed port (connection refused)."""
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")


def test_a_catalog_model_is_estimated_from_the_catalog_when_its_header_cannot_be_read(no_hub: None) -> None:
    result = invoke("estimate", GEMMA, "--ctx", "8192", "--gpus", "0", "--gpu-mem-mib", "16384", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    source = data["source"]
    assert source["kind"] == "catalog" and source["model"] == GEMMA
    assert source["header"].startswith("https://huggingface.co/") and "cannot read" in source["why"]
    assert data["model"]["arch"] == "gemma4" and data["model"]["params"] > 20e9
    (gpu,) = [device for device in data["devices"] if device["name"] == "CUDA0"]
    assert gpu["fits"] is True and 12_000 < gpu["total_mib"] < 16_384  # 26B at Q4_0: weights near 14 GiB

    text = invoke("estimate", GEMMA, "--ctx", "8192")
    assert text.exit_code == 0, text.output
    (line,) = [line for line in text.stdout.splitlines() if line.startswith("source")]
    assert f"the catalog's hyperparameters of {GEMMA}" in line and "its GGUF header could not be read" in line


def test_a_header_that_can_be_read_is_used_and_named(tmp_path: Path) -> None:
    path = write_model(tmp_path / "g.gguf", "gemma3", n_layer=4, file_type="q8_0")
    result = invoke("estimate", str(path), "--ctx", "2048", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["source"] == {"kind": "header", "header": str(path)}


def test_a_file_that_is_not_there_is_still_an_error_not_a_catalog_guess(no_hub: None, tmp_path: Path) -> None:
    result = invoke("estimate", str(tmp_path / "missing.gguf"))
    assert result.exit_code == 2 and "no such file" in result.stderr
