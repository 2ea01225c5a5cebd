import pytest

from controller.catalog import load_catalog
from controller.errors import CatalogError

SEED_MODELS = {"gemma4-26b-a4b-qat-q4_0", "qwen3.6-35b-a3b-iq4_xs", "qwen3.6-35b-a3b-q6_k"}


def test_builtin_catalog_has_the_seed_models_and_pinned_engines():
    catalog = load_catalog()
    assert SEED_MODELS <= set(catalog.models)
    gemma = catalog.model("gemma4-26b-a4b-qat-q4_0")
    assert gemma.engine == "upstream" and gemma.sliding_window  # ik_llama.cpp lacks the SWA cache
    assert gemma.url() == f"{gemma.hub_url}/google/gemma-4-26B-A4B-it-qat-q4_0-gguf/resolve/main/gemma-4-26B_q4_0-it.gguf"
    assert catalog.model("qwen3.6-35b-a3b-iq4_xs").engine == "ik"
    assert catalog.engine("upstream-02182fc").load_flags["mlock"] == ["--no-mmap", "--mlock"]
    assert catalog.engine("cpu-0c1e570").load_flags["mlock"] == ["--load-mode", "mlock"]
    assert catalog.engine("ik-022bd00a").slot == "ik"


def test_extra_catalog_overrides_and_adds(tmp_path):
    extra = tmp_path / "extra.yml"
    extra.write_text(f"""
models:
  gemma4-26b-a4b-qat-q4_0:
    name: pinned
    repo: google/gemma-4-26B-A4B-it-qat-q4_0-gguf
    file: gemma-4-26B_q4_0-it.gguf
    sha256: {'ab' * 32}
    engine: upstream
  tiny: {{name: t, repo: lab/r, file: t.gguf, engine: upstream}}
""")
    catalog = load_catalog([extra])
    assert catalog.model("gemma4-26b-a4b-qat-q4_0").sha256 == "ab" * 32
    assert catalog.model("tiny").url("http://127.0.0.1:9/") == "http://127.0.0.1:9/lab/r/resolve/main/t.gguf"


def test_unknown_ids_and_bad_entries_are_named(tmp_path):
    with pytest.raises(CatalogError, match="unknown model id 'nope'.*gemma4"):
        load_catalog().model("nope")
    bad = tmp_path / "bad.yml"
    bad.write_text("models:\n  x: {name: x, repo: r, file: f, engine: upstream, sha256: short}\n")
    with pytest.raises(CatalogError, match="x.sha256"):
        load_catalog([bad])
    bad.write_text("modles: {}\n")
    with pytest.raises(CatalogError, match="unknown top-level keys"):
        load_catalog([bad])
