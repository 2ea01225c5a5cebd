"""The compute-graph model: ggml's shapes and views, the scheduler's placement and copies, the allocator, and the
shortened graph, each checked against a number worked out by hand from llama.cpp 0c1e570's code."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from controller.stages.estimate import graph as graph_model
from controller.stages.estimate import memory
from controller.stages.estimate.ggml import F16, F32, Tensor, mul_mat, new_tensor, permute, reshape, view
from controller.stages.estimate.gguf_header import read_header
from controller.stages.estimate.memory import MIB, estimate, kv_plan, place_layers, resolve_settings
from controller.stages.estimate.model import model_spec
from controller.stages.estimate.sched import _Dyn
from lab.tinymodels import write_model


def spec_of(path: Path):
    return model_spec(read_header(path))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # 8 layers of 1024 wide (16 heads of 64, 4 KV heads), f16: the recorded CUDA cases' llama
    return spec_of(write_model(tmp_path_factory.mktemp("g") / "l.gguf", "llama", n_layer=8, n_embd=1024, n_head=16,
                               n_head_kv=4, n_ff=2816, n_vocab=32000, n_ctx_train=131072, file_type="f16",
                               header_only=True))


def test_views_keep_their_root_and_strides() -> None:
    a = new_tensor(F32, 64, 8, 512)
    r = reshape(a, 512, 512)
    v = view(r, [64, 8, 256, 2], [a.nb[1], a.nb[2], a.nb[2] * 256], 0)
    p = permute(v, 0, 2, 1, 3)
    assert r.view_src is a and v.view_src is a and p.view_src is a
    assert p.ne == [64, 256, 8, 2] and p.nb == [4, a.nb[2], a.nb[1], a.nb[2] * 256]
    assert p.nbytes == a.nbytes and not p.is_contiguous() and v.is_contiguous()
    assert mul_mat(new_tensor(F16, 1024, 2816), new_tensor(F32, 1024, 512)).ne == [2816, 512, 1, 1]


def test_the_allocator_reuses_the_best_fitting_hole_and_merges_neighbours() -> None:
    dyn = _Dyn(32)
    a, b, c = dyn.alloc(100), dyn.alloc(1000), dyn.alloc(50)
    assert (a, b, c) == (0, 128, 1152) and dyn.max_size == 1152 + 64
    dyn.free(b, 1000)
    assert dyn.alloc(500) == 128  # the hole, not the end
    dyn.free(a, 100)
    dyn.free(128, 500)
    assert dyn.blocks[0] == [0, 1152]  # the two holes and the space between merged
    assert dyn.max_size == 1216


def _plan(spec, **options):
    s = resolve_settings(spec, **options)
    place = place_layers(spec, s)
    return memory.compute_plan(spec, s, place, kv_plan(spec, s, place))


def test_the_host_keeps_the_graph_inputs_when_every_layer_is_on_the_gpu(llama) -> None:
    # inputs live on the CPU backend (pinned when a GPU exists): the f16 KQ mask (cells x tokens), the raw
    # embeddings input and the looked-up embeddings (1024 x tokens f32 each), token ids and positions (i32),
    # the cache rows to write (two i64 lists) and the output row ids
    plan = _plan(llama, ctx=32768, parallel=1, ubatch=2048, gpus=[0])
    mask = 32768 * 2048 * 2
    embeddings = 2 * 1024 * 2048 * 4
    ids = 2 * 2048 * 4 + 2 * 2048 * 8 + 32
    assert plan.model == "graph" and plan.pinned and plan.splits == 2  # the lookup on the CPU, the rest on the GPU
    assert plan.per_device[1] == mask + embeddings + ids  # the engine's CUDA_Host: 144.05 MiB (recorded case)
    # the GPU holds its own copy of the mask for as long as a layer needs it
    assert plan.per_device[0] >= mask


def test_a_quantised_cache_is_converted_to_f16_inside_the_flash_attention_result(llama) -> None:
    # CUDA's tensor-core kernels read f16: one layer's K and V, every cell of every stream (4 streams of 8192)
    q8 = _plan(llama, ctx=32768, parallel=4, kv_unified=False, cache_type_k="q8_0", cache_type_v="q8_0",
               gpus=[0]).per_device[0]
    converted = 2 * 8192 * 4 * 256 * 2  # K and V: cells x streams x (4 KV heads x 64) x 2 bytes
    mask = 8192 * (512 // 4) * 4 * 2  # the GPU's copy: cells x tokens per stream x streams, f16
    result = 1024 * 512 * 4
    assert q8 >= converted + mask + result
    f16 = _plan(llama, ctx=32768, parallel=4, kv_unified=False, gpus=[0]).per_device[0]
    assert f16 < converted < q8
    cpu = _plan(llama, ctx=32768, parallel=4, kv_unified=False, cache_type_k="q8_0", cache_type_v="q8_0")
    assert cpu.per_device[0] < q8  # the CPU kernel reads the quantised cache in place


def test_layers_on_the_cpu_have_their_weights_copied_to_the_gpu_for_a_prompt_sized_batch(llama) -> None:
    # -ngl 5: blocks 4-7 and the output on the GPU; blocks 0-3 run on the GPU too (op offload, batch >= 32), each
    # weight copied into the GPU's buffer when its split starts, and each layer's K and V views crossing as well
    partial = _plan(llama, ctx=20000, parallel=1, gpus=[0], n_gpu_layers=5)
    ffn_weight = 1024 * 2816 * 2
    kv_view = 20224 * 256 * 2
    assert partial.splits > 20
    assert partial.per_device[0] >= ffn_weight + 2 * kv_view
    # a batch under 32 rows stays with the weights on the CPU: no copies, the host computes those layers
    small = _plan(llama, ctx=20000, parallel=1, gpus=[0], n_gpu_layers=5, ubatch=16)
    assert small.per_device[0] < ffn_weight


def test_flash_attention_without_a_cuda_kernel_runs_on_the_cpu_every_layer(tmp_path: Path) -> None:
    # head size 48 has no CUDA flash-attention kernel: the op goes to the CPU and each layer splits twice
    spec = spec_of(write_model(tmp_path / "h48.gguf", "llama", n_layer=6, n_embd=288, n_head=6, n_head_kv=2,
                               n_ff=768, file_type="f16", header_only=True))
    plan = _plan(spec, ctx=15000, parallel=3, kv_unified=False, flash_attn="on", gpus=[0])
    assert plan.splits == 2 + 2 * 6


def test_the_batch_is_clamped_by_the_context_before_it_is_padded(llama) -> None:
    # -c 1000 -ub 1024: llama_context takes n_batch = min(1000, 2048) and n_ubatch = 1000, then pads n_ctx to 1024
    s = resolve_settings(llama, ctx=1000, parallel=1, ubatch=1024)
    shape = graph_model.shape_for(llama, s.ctx, s.ubatch, s.batch, s.parallel, s.kv_unified, 1024, 1024,
                                  s.flash_attn, "f16", "f16")
    assert shape.n_tokens == 1000 and shape.n_outputs == 1


def test_an_unset_context_is_the_training_context_per_stream(llama) -> None:
    # --fit (on by default) gives each slot the training context when the slots have their own caches
    assert resolve_settings(llama, parallel=3).ctx == 131072 * 3
    assert resolve_settings(llama, parallel=3, kv_unified=True).ctx == 131072
    assert resolve_settings(llama).ctx == 131072  # 4 unified slots by default


def test_the_pinned_host_buffer_is_counted_in_the_host_total(llama) -> None:
    result = estimate(llama, resolve_settings(llama, ctx=8192, parallel=2, gpus=[0]))
    host = result.devices[-1]
    assert host.pinned_mib == pytest.approx(host.compute_mib + host.output_mib)
    assert host.total_mib == pytest.approx(host.weights_mib + host.kv_mib + host.compute_mib + host.output_mib)
    assert host.output_mib * MIB == 32000 * 4 * 2  # logits of one output per slot
    data = result.to_json()
    assert data["host_pinned"]["total_mib"] == pytest.approx(host.pinned_mib, abs=0.01)
    assert data["compute"]["model"] == "graph"
    cpu_only = estimate(llama, resolve_settings(llama, ctx=8192, parallel=2))
    assert cpu_only.to_json()["host_pinned"] is None and cpu_only.devices[-1].pinned_mib == 0


def _compare(spec, **options) -> None:
    s = resolve_settings(spec, **options)
    place = place_layers(spec, s)
    kv = kv_plan(spec, s, place)
    short = memory.compute_plan(spec, s, place, kv).per_device
    whole = memory.compute_plan(spec, s, place, kv, compress=False).per_device
    assert short == whole, options


def test_the_shortened_graph_sizes_the_buffers_like_the_whole_graph(tmp_path: Path) -> None:
    rng = random.Random(7)
    models = [
        ("llama", {"n_layer": 30, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512}),
        ("qwen3moe", {"n_layer": 20, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_expert": 8,
                      "n_expert_used": 2, "n_ff_exp": 128}),
        ("gemma3", {"n_layer": 26, "n_embd": 256, "n_head": 4, "n_head_kv": 1, "head_dim": 128, "n_ff": 512,
                    "sliding_window": 128, "swa_pattern": 3}),
    ]
    for arch, shape in models:
        spec = spec_of(write_model(tmp_path / f"{arch}.gguf", arch, n_vocab=2000, n_ctx_train=65536,
                                   file_type="q8_0", header_only=True, **shape))
        assert len(graph_model.layer_plan(spec, [0] * spec.n_layer, spec.graph_tensors)) < spec.n_layer
        for _ in range(6):
            gpus = rng.choice([[], [0], [0], [0, 1]])
            _compare(spec, ctx=rng.choice([4096, 20000]), parallel=rng.choice([1, 3]),
                     kv_unified=rng.choice([True, False]), cache_type_k=rng.choice(["f16", "q8_0"]),
                     ubatch=rng.choice([256, 512]), gpus=gpus, gpu_mem_mib=[16384] * len(gpus),
                     n_gpu_layers=rng.choice([None, 7, 0]) if gpus else None)


def test_architectures_not_mirrored_fall_back_to_the_formula_and_say_so(tmp_path: Path) -> None:
    spec = spec_of(write_model(tmp_path / "l.gguf", "llama", n_layer=2, file_type="f16", header_only=True))
    spec.arch = "mistral3"  # a graph this module does not mirror
    result = estimate(spec, resolve_settings(spec, ctx=4096, gpus=[0]))
    assert result.compute_plan.model == "formula"
    assert any("formula" in note for note in result.notes)
    assert result.devices[-1].pinned_mib > 0  # the host's buffer is pinned all the same


def test_a_tensor_is_freed_after_its_last_consumer() -> None:
    # the node keeps the allocator's state on itself: every graph is built afresh
    t = Tensor(F32, [4, 4])
    assert (t.n_children, t.n_views, t.allocated, t.backend) == (0, 0, False, -1)
