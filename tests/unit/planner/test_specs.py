"""Model memory without downloads: catalog hyperparameters, GGUF headers, and the kit's measured figures."""

from __future__ import annotations

import pytest
import yaml

from controller.errors import CatalogError
from controller.model.catalog import load_catalog
from controller.stages.estimate.gguf_header import read_header
from controller.stages.estimate.memory import estimate, resolve_settings
from controller.stages.estimate.model import is_expert_tensor, model_spec
from controller.stages.planner.specs import SizedMemory, SpecMemory, memory_model, spec_from_hparams
from lab.tinymodels import write_model
from tests.unit.planner.helpers import catalog

ISSUE_IDS = {"gemma4-26b-a4b-qat-q4_0", "qwen3.6-35b-a3b-iq4_xs", "qwen3.6-35b-a3b-q6_k", "qwen3.6-27b-q4_k_m",
             "qwen3.5-122b-a10b-q8_0"}

# Published parameter counts (model cards), an independent check that the transcribed hparams are right.
PUBLISHED_PARAMS_B = {
    "gemma4-26b-a4b-qat-q4_0": 25.2,  # "26B-A4B": 25.2B total
    "qwen3.6-35b-a3b-iq4_xs": 35.5,  # 35B + the MTP layer kept in this GGUF
    "qwen3.6-27b-q4_k_m": 27.0,
    "qwen3.5-122b-a10b-q8_0": 122.0,
    "qwen3-4b-instruct-2507-q8_0": 4.0,
    "gemma4-31b-it-q8_0": 30.7,
}


def test_catalog_has_the_issue_models_a_gate_and_a_reviewer_each_with_a_shape():
    cat = catalog()
    assert ISSUE_IDS <= set(cat.models)
    assert "qwen3-4b-instruct-2507-q8_0" in cat.models and "gemma4-31b-it-q8_0" in cat.models
    for entry in cat.models.values():
        assert entry.arch and entry.hparams and entry.file_type, entry.id
    assert cat.model("qwen3.6-27b-q4_k_m").dense and not cat.model("qwen3.5-122b-a10b-q8_0").dense


@pytest.mark.parametrize("model_id,billions", sorted(PUBLISHED_PARAMS_B.items()))
def test_hparams_give_the_published_parameter_count(model_id, billions):
    spec = spec_from_hparams(catalog().model(model_id))
    assert spec.params / 1e9 == pytest.approx(billions, rel=0.02)


def test_tensors_are_scaled_to_the_catalog_file_size():
    entry = catalog().model("qwen3.6-35b-a3b-iq4_xs")  # 4.19 bpw: a mix the file_type alone does not describe
    spec = spec_from_hparams(entry)
    assert spec.size_bytes == pytest.approx(entry.size_bytes, rel=1e-4)
    experts = sum(t.nbytes for t in spec.tensors if is_expert_tensor(t.name))
    assert 0.85 < experts / spec.size_bytes < 0.95  # routed experts are most of an A3B model
    assert spec.n_layer == 40 and spec.n_layer_all == 41  # the MTP layer is not in the main context


def test_qwen_kv_per_token_matches_the_kits_f16_measurement():
    """Kit: ~22.5 kB/token at f16 on the dual-card setup (10 attention layers + the MTP head's layer)."""
    spec = spec_from_hparams(catalog().model("qwen3.6-35b-a3b-q6_k"))
    result = estimate(spec, resolve_settings(spec, ctx=131072, parallel=1))
    with_mtp = result.kv.bytes_per_token * (result.kv.layers + 1) / result.kv.layers
    assert with_mtp == pytest.approx(catalog().model("qwen3.6-35b-a3b-q6_k").kv_bytes_per_token["f16"], rel=0.02)


@pytest.mark.parametrize("arch,kwargs", [
    ("llama", {"n_layer": 4, "n_embd": 512, "n_head": 8, "n_head_kv": 2, "n_ff": 1536, "n_vocab": 2000}),
    ("qwen3moe", {"n_layer": 4, "n_embd": 512, "n_head": 8, "n_head_kv": 4, "n_ff": 1024, "n_vocab": 2000,
                  "n_expert": 8, "n_expert_used": 2, "n_ff_exp": 256}),
    ("gemma3", {"n_layer": 6, "n_embd": 512, "n_head": 8, "n_head_kv": 4, "n_ff": 1024, "n_vocab": 2000,
                "sliding_window": 256, "swa_pattern": 3, "tied_embeddings": True}),
])
def test_weights_from_hparams_match_a_real_gguf_header_of_the_same_shape(tmp_path, arch, kwargs):
    path = write_model(tmp_path / f"{arch}.gguf", arch, file_type="q8_0", header_only=True, **kwargs)
    real = model_spec(read_header(path))
    hparams = {key.removeprefix(f"{arch}."): value for key, value in read_header(path).metadata.items()
               if key.startswith(f"{arch}.") and isinstance(value, (int, float, list))}
    entry = load_catalog().model("qwen3-4b-instruct-2507-q8_0").model_copy(update={
        "id": "same-shape", "arch": arch, "hparams": hparams, "file_type": "Q8_0", "size_bytes": None,
        "tied_embeddings": kwargs.get("tied_embeddings", False)})
    synthetic = spec_from_hparams(entry)
    real_bytes = sum(t.nbytes for t in real.tensors)
    assert sum(t.nbytes for t in synthetic.tensors) == pytest.approx(real_bytes, rel=0.01)
    real_experts = sum(t.nbytes for t in real.tensors if is_expert_tensor(t.name))
    assert sum(t.nbytes for t in synthetic.tensors if is_expert_tensor(t.name)) == pytest.approx(real_experts, abs=1)
    settings = resolve_settings(real, ctx=4096, parallel=1, gpus=[0, 1], gpu_mem_mib=[16384, 16384])
    for ours, theirs in zip(estimate(synthetic, settings).devices, estimate(real, settings).devices):
        assert ours.total_mib == pytest.approx(theirs.total_mib, rel=0.02, abs=0.5)


def test_a_gguf_header_replaces_the_catalog_shape(tmp_path):
    path = write_model(tmp_path / "m.gguf", "llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                       file_type="q8_0", header_only=True)
    model = memory_model(catalog().model("gemma4-26b-a4b-qat-q4_0"), str(path))
    assert isinstance(model, SpecMemory) and model.spec.arch == "llama" and "GGUF header" in model.source


def _entry(tmp_path, body):
    extra = tmp_path / "c.yml"
    extra.write_text(yaml.safe_dump({"models": {"m": {"name": "m", "repo": "r/r", "file": "m.gguf",
                                                      "engine": "upstream", **body}}}))
    return load_catalog([extra]).model("m")


def test_measured_figures_scale_kv_with_context(tmp_path):
    entry = _entry(tmp_path, {"size_bytes": 8 << 30, "measured": True, "kv_bytes_per_token": {"q8_0": 17000}})
    model = memory_model(entry)
    assert isinstance(model, SizedMemory) and not model.notes
    small = resolve_settings(model_spec(read_header(write_model(tmp_path / "x.gguf", header_only=True))),
                             ctx=32768, cache_type_k="q8_0", cache_type_v="q8_0", gpus=[0], gpu_mem_mib=[16384])
    large = small.__class__(**{**small.__dict__, "ctx": 65536})
    grown = model.device_mib(large)[0] - model.device_mib(small)[0]
    assert grown == pytest.approx(17000 * 32768 / 2**20)


def test_incomplete_entries_say_what_to_add(tmp_path):
    with pytest.raises(CatalogError, match="hparams need 'arch'"):
        _entry(tmp_path, {"hparams": {"block_count": 2}})
    with pytest.raises(CatalogError, match="measured entry needs size_bytes and kv_bytes_per_token"):
        _entry(tmp_path, {"measured": True, "size_bytes": 100})
    with pytest.raises(CatalogError, match="file_type 'Q2_XYZ'"):
        spec_from_hparams(_entry(tmp_path, {"arch": "llama", "file_type": "Q2_XYZ", "hparams": {"block_count": 2}}))
    with pytest.raises(CatalogError, match="neither hyperparameters nor a file size"):
        memory_model(_entry(tmp_path, {}))
