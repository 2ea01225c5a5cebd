"""Public llama.cpp / ik_llama.cpp load logs parse, and the estimator reproduces their KV buffers."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.stages.estimate.llamalog import context_settings, header_metadata, parse_log
from controller.stages.estimate.source import estimate_model
from lab.tinymodels import write_gguf

# log -> (engine, KV MiB the engine reported); the engines the product runs (upstream, ik_llama.cpp)
TARGETED = {
    "llamalog-ik-gemma3-27b-32k-f16-a6000.txt": ("ik", 15872.0),
    "llamalog-ik-gemma3-27b-131072-f16-cpu-only-arm-full-swa-cache.txt": ("ik", 63488.0),
    "llamalog-ik-deepseek-v3-8k-mla-f16-4gpu-partial-offload.txt": ("ik", 549.0),
    "llamalog-ik-llama3.1-8b-1k-k-iq4_nl-v-f16-windows-perplexity.txt": ("ik", 82.0),
    "llamalog-ik-nemotron-ultra-253b-12k-k-q8_0-v-q4_0-4gpu.txt": ("ik", 1248.08),
    "llamalog-ik-qwen3-235b-a22b-32k-q8_0-2x3090-collapsed-spaces-oom.txt": ("ik", 3196.04),
    "llamalog-ik-qwen3-32b-8k-f16-2xT4-sm-row-annotated.txt": ("ik", 2048.0),
    "llamalog-mainline-qwen3-30b-a3b-16k-f16-4090+5090-cpu-experts-llama-cli.txt": ("upstream", 1536.0),
    "llamalog-qwen3-0.6b-4k-f16-jetson-orin-ngl0-llama-server.txt": ("upstream", 448.0),
    "llamalog-devstral-small2-24b-256-f16-gb10-ngl0-cpu-mapped.txt": ("upstream", 40.0),
}


def test_buffers_and_settings_are_read_from_the_log_variants(real_fixtures: Path) -> None:
    crlf = parse_log((real_fixtures / "llamalog-ik-nemotron-ultra-253b-12k-k-q8_0-v-q4_0-4gpu.txt").read_text())
    assert crlf.arch == "deci" and crlf.is_ik
    assert crlf.buffers["KV"] == {"CUDA0": 429.02, "CUDA1": 292.52, "CUDA2": 331.53, "CUDA3": 195.01}
    assert (crlf.type_k, crlf.type_v, crlf.kv_self_mib) == ("q8_0", "q4_0", 1248.0)
    assert len(crlf.meta_list("n_head_kv")) == 162
    collapsed = parse_log(
        (real_fixtures / "llamalog-ik-qwen3-235b-a22b-32k-q8_0-2x3090-collapsed-spaces-oom.txt").read_text())
    assert collapsed.arch == "qwen3moe" and collapsed.context["n_ctx"] == "32768"
    annotated = parse_log((real_fixtures / "llamalog-ik-qwen3-32b-8k-f16-2xT4-sm-row-annotated.txt").read_text())
    assert annotated.buffers["KV"] == {"CUDA0": 2048.0}  # the poster's "# where is CUDA1?" is ignored
    mainline = parse_log(
        (real_fixtures / "llamalog-mainline-qwen3-30b-a3b-16k-f16-4090+5090-cpu-experts-llama-cli.txt").read_text())
    assert not mainline.is_ik and mainline.kv_cells == [16384]
    assert context_settings(mainline)["flash_attn"] == "off"


def test_metadata_rebuilds_per_layer_arrays_the_dump_truncated(real_fixtures: Path) -> None:
    log = parse_log((real_fixtures / "llamalog-ik-nemotron-ultra-253b-12k-k-q8_0-v-q4_0-4gpu.txt").read_text())
    meta = header_metadata(log)
    assert len(meta["deci.attention.head_count_kv"]) == 162
    assert meta["deci.attention.head_count_kv"][9] == 0
    assert meta["deci.vocab_size"] == 128256
    assert not any(key.startswith("tokenizer.") for key in meta)


@pytest.mark.parametrize("name", sorted(TARGETED))
def test_estimate_reproduces_the_logged_kv_within_2_percent(real_fixtures: Path, tmp_path: Path, name: str) -> None:
    engine, reported = TARGETED[name]
    log = parse_log((real_fixtures / name).read_text(errors="replace"))
    assert log.total("KV") == pytest.approx(reported, abs=0.01)
    gguf = write_gguf(tmp_path / "h.gguf", log.arch, header_metadata(log), [], header_only=True)
    settings = context_settings(log) | {"engine": engine}
    estimated = estimate_model(str(gguf), **settings).kv.total_bytes / 2**20
    assert estimated == pytest.approx(reported, rel=0.02)


def test_live_server_log_prefixes_are_stripped() -> None:
    # the 0c1e570 server at -lv 4 prefixes "time level"; older ones "[pid]"
    text = (
        "0.00.027.031 I print_info: arch                  = gemma3\n"
        "[47161] 0.01.057.525 I llama_context: n_ctx                 = 4096\n"
        "0.00.028.221 I llama_kv_cache:        CPU KV buffer size =     0.50 MiB\n"
        "0.00.028.556 I llama_kv_cache:        CPU KV buffer size =     0.12 MiB\n"
        "0.00.027.824 I load_tensors:   CPU_Mapped model buffer size =     0.12 MiB\n"
        "0.00.030.215 I sched_reserve:        CPU compute buffer size =     5.64 MiB\n"
    )
    log = parse_log(text)
    assert log.arch == "gemma3" and log.context["n_ctx"] == "4096"
    assert log.total("KV") == pytest.approx(0.62) and log.total("model") == 0.12 and log.total("compute") == 5.64
