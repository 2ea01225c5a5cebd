"""The memory model's rules, each checked against a number worked out by hand from llama.cpp's code."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType

from controller.stages.estimate.gguf_header import read_header
from controller.stages.estimate.memory import (
    MIB,
    EstimateInputError,
    estimate,
    kv_cells,
    largest_fitting_context,
    place_layers,
    resolve_settings,
    row_bytes,
    weights_per_device,
)
from controller.stages.estimate.model import model_spec
from lab.tinymodels import TensorSpec, write_gguf, write_model


def spec_of(path: Path):
    return model_spec(read_header(path))


def header_only(tmp_path: Path, arch: str, keys: dict[str, Any], tensors: list[TensorSpec] = ()) -> Path:
    """A GGUF with only the given metadata (and tensor infos): enough to describe any architecture."""
    metadata = {f"{arch}.{k}" if not k.startswith(("general.", "tokenizer.")) else k: v for k, v in keys.items()}
    return write_gguf(tmp_path / f"{arch}.gguf", arch, metadata, list(tensors), header_only=True)


@pytest.fixture
def llama(tmp_path: Path):
    # 4 layers, 2 KV heads of 64: K and V rows are 128 wide
    return spec_of(write_model(tmp_path / "l.gguf", "llama", n_layer=4, n_embd=256, n_head=4, n_head_kv=2,
                               n_ff=512, file_type="f16"))


@pytest.mark.parametrize(
    ("ctx", "parallel", "unified", "expected"),
    [
        (1000, 4, True, (1024, 1)),  # context padded to 256, one shared stream
        (1000, 4, False, (256, 4)),  # per-sequence: 1024 / 4 = 256 cells each
        (5000, 3, False, (1792, 3)),  # 5120 / 3 = 1706 -> padded to 1792 per stream
        (4096, 1, False, (4096, 1)),
    ],
)
def test_cells_are_padded_to_256_per_stream(llama, ctx, parallel, unified, expected) -> None:
    s = resolve_settings(llama, ctx=ctx, parallel=parallel, kv_unified=unified)
    cells, _swa, streams = kv_cells(llama, s)
    assert (cells, streams) == expected


@pytest.mark.parametrize(
    ("cache", "row"),
    [("f32", 512), ("f16", 256), ("bf16", 256), ("q8_0", 136), ("q5_1", 96), ("q5_0", 88), ("q4_1", 80),
     ("q4_0", 72), ("iq4_nl", 72)],
)
def test_quantised_cache_rows_use_block_sizes(llama, cache: str, row: int) -> None:
    assert row_bytes(GGMLQuantizationType[cache.upper()], 128) == row
    s = resolve_settings(llama, ctx=4096, parallel=1, cache_type_k=cache, cache_type_v=cache)
    result = estimate(llama, s)
    assert result.kv.bytes_per_token == 4 * 2 * row
    assert result.kv.total_bytes == 4 * 2 * row * 4096


def test_mixed_k_and_v_types(llama) -> None:
    s = resolve_settings(llama, ctx=1024, parallel=1, cache_type_k="q8_0", cache_type_v="f16")
    assert estimate(llama, s).kv.total_bytes == 4 * (136 + 256) * 1024


def test_quantised_cache_needs_divisible_head_width(tmp_path: Path) -> None:
    odd = spec_of(header_only(tmp_path, "llama", {"block_count": 1, "embedding_length": 80, "attention.head_count": 1,
                                                  "context_length": 512}))
    with pytest.raises(EstimateInputError, match="divisible by 32"):
        estimate(odd, resolve_settings(odd, cache_type_k="q8_0"))


def test_engine_defaults(llama) -> None:
    upstream = resolve_settings(llama)
    assert (upstream.parallel, upstream.kv_unified, upstream.ctx, upstream.ubatch, upstream.flash_attn) == (
        4, True, 4096, 512, True)
    explicit = resolve_settings(llama, parallel=2)
    assert (explicit.parallel, explicit.kv_unified) == (2, False)
    ik = resolve_settings(llama, engine="ik")
    assert (ik.parallel, ik.kv_unified) == (1, True)


def test_sliding_window_layers_upstream_vs_ik(tmp_path: Path) -> None:
    # gemma3, 4 layers, window 128, pattern 2: layers 0 and 2 slide, 1 and 3 are full
    spec = spec_of(write_model(tmp_path / "g.gguf", "gemma3", n_layer=4, sliding_window=128, swa_pattern=2))
    assert [layer.kind for layer in spec.layers] == ["swa", "full", "swa", "full"]
    up = estimate(spec, resolve_settings(spec, ctx=4096, parallel=1))
    # iSWA: min(4096, 128 * 1 + 512 ubatch) = 640 -> padded to 768 cells
    assert (up.kv.cells, up.kv.swa_cells, up.kv.swa_layers) == (4096, 768, 2)
    per_cell = 2 * 2 * 16 * 2  # K+V, 2 heads of 16, f16
    assert up.kv.total_bytes == 2 * per_cell * 4096 + 2 * per_cell * 768
    unified = estimate(spec, resolve_settings(spec, ctx=4096))  # 4 slots share the window: 128 * 4 + 512
    assert unified.kv.swa_cells == 1024
    ik = estimate(spec, resolve_settings(spec, ctx=4096, engine="ik"))
    assert ik.kv.total_bytes == 4 * per_cell * 4096  # ik_llama.cpp keeps the whole context on SWA layers


def test_per_layer_kv_heads_and_attention_free_layers(tmp_path: Path) -> None:
    # deci-style: head_count_kv per layer, zero for layers without attention
    spec = spec_of(header_only(tmp_path, "deci", {
        "block_count": 4, "embedding_length": 256, "context_length": 2048,
        "attention.head_count": [4, 0, 4, 4], "attention.head_count_kv": [2, 0, 1, 4],
    }))
    assert [layer.kind for layer in spec.layers] == ["full", "none", "full", "full"]
    result = estimate(spec, resolve_settings(spec, ctx=1024, parallel=1))
    assert result.kv.layers == 3
    assert result.kv.bytes_per_token == (2 + 1 + 4) * 64 * 2 * 2


def test_v_cache_without_flash_attention_is_padded_to_the_widest_layer(tmp_path: Path) -> None:
    spec = spec_of(header_only(tmp_path, "deci", {
        "block_count": 2, "embedding_length": 256, "context_length": 2048,
        "attention.head_count": [4, 4], "attention.head_count_kv": [1, 4],
    }))
    fa = estimate(spec, resolve_settings(spec, ctx=256, parallel=1, flash_attn="on"))
    no_fa = estimate(spec, resolve_settings(spec, ctx=256, parallel=1, flash_attn="off"))
    assert fa.kv.bytes_per_token == (64 + 64 + 256 + 256) * 2
    assert no_fa.kv.bytes_per_token == (64 + 256 + 256 + 256) * 2


def test_mla_caches_only_the_compressed_k(tmp_path: Path) -> None:
    # DeepSeek-V3 as converted today: one KV head of kv_lora_rank + rope = 576, value 512 (absorbed)
    spec = spec_of(header_only(tmp_path, "deepseek2", {
        "block_count": 61, "embedding_length": 7168, "context_length": 163840,
        "attention.head_count": 128, "attention.head_count_kv": 1, "attention.key_length": 576,
        "attention.value_length": 512, "attention.key_length_mla": 192, "attention.value_length_mla": 128,
        "attention.kv_lora_rank": 512, "rope.dimension_count": 64,
    }))
    result = estimate(spec, resolve_settings(spec, ctx=8192, parallel=1))
    assert result.kv.total_bytes == 61 * 8192 * 576 * 2
    # ik_llama.cpp on an older GGUF (no *_mla keys, 128 heads): it still caches c^KV = 512 + 64
    old = spec_of(header_only(tmp_path / "old", "deepseek2", {
        "block_count": 61, "embedding_length": 7168, "context_length": 163840,
        "attention.head_count": 128, "attention.head_count_kv": 128, "attention.key_length": 192,
        "attention.value_length": 128, "attention.kv_lora_rank": 512, "rope.dimension_count": 64,
    }))
    ik = estimate(old, resolve_settings(old, ctx=8192, engine="ik"))
    assert ik.kv.total_bytes == 61 * 8192 * 576 * 2 == 549 * MIB


def test_hybrid_recurrent_layers_hold_state_not_kv(tmp_path: Path) -> None:
    # Qwen3.6-35B-A3B shape: 40 layers, full attention every 4th, gated delta net elsewhere, one MTP layer
    spec = spec_of(header_only(tmp_path, "qwen35moe", {
        "block_count": 41, "nextn_predict_layers": 1, "embedding_length": 2048, "context_length": 262144,
        "attention.head_count": 16, "attention.head_count_kv": 2, "attention.key_length": 256,
        "attention.value_length": 256, "full_attention_interval": 4, "ssm.conv_kernel": 4, "ssm.state_size": 128,
        "ssm.group_count": 16, "ssm.time_step_rank": 32, "ssm.inner_size": 4096, "expert_count": 256,
        "expert_used_count": 8,
    }))
    kinds = [layer.kind for layer in spec.layers]
    assert kinds.count("full") == 10 and kinds.count("recurrent") == 30 and kinds[-1] == "nextn"
    result = estimate(spec, resolve_settings(spec, ctx=131072, parallel=1))
    assert result.kv.bytes_per_token == 10 * 2 * 2 * 256 * 2  # 20 KiB per token of context
    state = 30 * ((4 - 1) * (4096 + 2 * 16 * 128) + 128 * 4096) * 4
    assert result.kv.recurrent_bytes == state
    assert result.kv.total_bytes == 20480 * 131072 + state


def test_output_and_layers_follow_ngl_and_embeddings_stay_on_cpu(llama) -> None:
    s = resolve_settings(llama, ctx=1024, gpus=[0], n_gpu_layers=2)
    place = place_layers(llama, s)
    # n_layer + 1 = 5 slots; the last 2 (block 3 and the output layer) go to the GPU
    assert place.layer_device == [1, 1, 1, 0] and place.output_device == 0
    weights = weights_per_device(llama, s, place)
    embd = next(t for t in llama.tensors if t.name == "token_embd.weight").nbytes
    block3 = sum(-(-t.nbytes // 32) * 32 for t in llama.tensors if t.name.startswith("blk.3."))
    output = sum(-(-t.nbytes // 32) * 32 for t in llama.tensors if t.name.startswith("output"))
    assert weights[0] == block3 + output
    assert weights[1] >= embd
    result = estimate(llama, s)
    assert result.devices[0].kv_mib * MIB == result.kv.total_bytes / 4  # one of four layers' KV is on the GPU


def test_ngl_equal_to_n_layer_leaves_the_first_block_not_the_output_on_cpu(llama) -> None:
    # the output layer is the last of the n_layer + 1 offloadable slots, so it is offloaded first
    s = resolve_settings(llama, ctx=1024, gpus=[0], n_gpu_layers=4)
    place = place_layers(llama, s)
    assert place.layer_device == [1, 0, 0, 0] and place.output_device == 0


def test_layer_split_follows_gpu_memory_and_none_uses_one_gpu(llama) -> None:
    split = place_layers(llama, resolve_settings(llama, gpus=[0, 1], gpu_mem_mib=[3000, 1000]))
    assert split.layer_device == [0, 0, 0, 0] or split.layer_device == [0, 0, 0, 1]
    assert split.layer_device.count(0) >= 3
    even = place_layers(llama, resolve_settings(llama, gpus=[0, 1], gpu_mem_mib=[1000, 1000]))
    assert even.layer_device == [0, 0, 0, 1] and even.output_device == 1
    none = place_layers(llama, resolve_settings(llama, gpus=[0, 1], split_mode="none"))
    assert set(none.layer_device) == {0} and none.output_device == 0


def test_tensor_split_divides_layers_and_kv_across_gpus(llama) -> None:
    s = resolve_settings(llama, ctx=2048, parallel=1, gpus=[0, 1], split_mode="tensor")
    result = estimate(llama, s)
    assert result.devices[0].kv_mib == pytest.approx(result.devices[1].kv_mib)
    assert result.devices[0].kv_mib * 2 * MIB == pytest.approx(result.kv.total_bytes)


def test_cpu_moe_keeps_experts_in_host_memory(tmp_path: Path) -> None:
    spec = spec_of(write_model(tmp_path / "m.gguf", "qwen3moe", n_expert=8, n_expert_used=2, file_type="f16"))
    gpu = estimate(spec, resolve_settings(spec, ctx=1024, gpus=[0]))
    moe = estimate(spec, resolve_settings(spec, ctx=1024, gpus=[0], cpu_moe=True))
    experts = sum(t.nbytes for t in spec.tensors if "_exps." in t.name)
    assert gpu.devices[0].weights_mib - moe.devices[0].weights_mib == pytest.approx(experts / MIB, abs=0.01)
    assert moe.devices[1].weights_mib - gpu.devices[1].weights_mib == pytest.approx(experts / MIB, abs=0.01)


def test_tied_embeddings_are_copied_to_the_gpu_with_the_output_layer(tmp_path: Path) -> None:
    spec = spec_of(write_model(tmp_path / "t.gguf", "llama", tied_embeddings=True, file_type="f16"))
    assert spec.tied_embeddings
    result = estimate(spec, resolve_settings(spec, ctx=1024, gpus=[0]))
    embd = next(t for t in spec.tensors if t.name == "token_embd.weight").nbytes
    assert result.devices[0].weights_mib * MIB >= embd
    assert result.devices[1].weights_mib * MIB >= embd


def test_gpus_carry_overhead_and_fit_is_reported(llama) -> None:
    result = estimate(llama, resolve_settings(llama, ctx=1024, gpus=[0], gpu_mem_mib=[450]))
    gpu = result.devices[0]
    assert gpu.overhead_mib > 0 and gpu.total_mib == pytest.approx(
        gpu.weights_mib + gpu.kv_mib + gpu.compute_mib + gpu.overhead_mib)
    assert gpu.fits is False or gpu.total_mib <= 450
    assert result.devices[1].overhead_mib == 0


def test_compute_grows_with_ubatch_and_without_flash_attention(llama) -> None:
    base = estimate(llama, resolve_settings(llama, ctx=4096, parallel=1)).compute[-1]
    big_ub = estimate(llama, resolve_settings(llama, ctx=4096, parallel=1, ubatch=2048)).compute[-1]
    no_fa = estimate(llama, resolve_settings(llama, ctx=4096, parallel=1, flash_attn="off")).compute[-1]
    assert big_ub > base and no_fa > base


def test_unknown_architecture_is_estimated_with_a_note(tmp_path: Path) -> None:
    spec = spec_of(header_only(tmp_path, "futurenet", {
        "block_count": 2, "embedding_length": 128, "context_length": 1024, "attention.head_count": 2,
    }, [TensorSpec("token_embd.weight", (300, 128), GGMLQuantizationType.F16)]))
    result = estimate(spec, resolve_settings(spec, ctx=1024, parallel=1))
    assert result.kv.total_bytes == 2 * 2 * 128 * 2 * 1024
    assert result.weights[-1] == 300 * 128 * 2
    assert any("futurenet" in note and "unknown" in note for note in result.notes)


def test_bad_settings_are_refused(llama) -> None:
    with pytest.raises(EstimateInputError, match="cache type"):
        resolve_settings(llama, cache_type_k="q3_k")
    with pytest.raises(EstimateInputError, match="one per GPU"):
        resolve_settings(llama, gpus=[0, 1], gpu_mem_mib=[16000])
    with pytest.raises(EstimateInputError, match="split mode"):
        resolve_settings(llama, split_mode="row")


def test_largest_fitting_context_is_the_biggest_that_stays_within_budget(llama) -> None:
    s = resolve_settings(llama, ctx=1024, parallel=1, gpus=[0], gpu_mem_mib=[16384])
    base = estimate(llama, s).devices[0].total_mib
    budget = base + 1.0  # one more MiB: KV is 4 layers * 2 * 256 B = 2 KiB per cell, so ~512 more cells fit
    ctx = largest_fitting_context(llama, s, budget)
    assert ctx % 256 == 0 and ctx > 1024
    assert estimate(llama, replace(s, ctx=ctx)).devices[0].total_mib <= budget
    assert estimate(llama, replace(s, ctx=ctx + 256)).devices[0].total_mib > budget or ctx == llama.n_ctx_train
