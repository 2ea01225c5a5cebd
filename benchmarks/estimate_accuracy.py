"""How close ``controller estimate`` comes to what llama.cpp really allocates.

(a) The real CPU llama-server (llama.cpp 0c1e570) at ``-lv 4`` on generated models — llama,
    qwen3moe, gemma3 with a sliding window; several cache types, contexts, slot counts and unified
    settings; 1 MiB to > 500 MiB files. Targets: KV and weights within 1% (or 1 MiB), compute
    within 10% (or 32 MiB).
(b) Public load logs (../shared/fixtures/real/llamalog-*.txt): each log's metadata is written back
    as a header-only GGUF and estimated with the log's own settings. Target: KV within 2% for the
    engines the product runs (upstream llama.cpp, ik_llama.cpp); the others are listed with why.
(c) The kit's figures in DESIGN.md, from the models' published configs (sources cited below).
(d) The CUDA llama-server (the same llama.cpp commit, built for CUDA) on a real GPU
    (../shared/fixtures/gpu-h100-580/cuda-truth/): each recorded case's hyperparameters written as a
    header-only GGUF and estimated with ``--gpus 0`` and the case's settings. Targets: weights and KV
    within 1%, CUDA0 and CUDA_Host compute within 10% (or 32 MiB), the GPU's total never under what
    the engine allocated.

    .venv/bin/python benchmarks/estimate_accuracy.py [--only a|b|c|d] [--dir /var/tmp/est-bench]

Exit status 1 if any targeted row fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from controller.stages.estimate.llamalog import context_settings, header_metadata, parse_log
from controller.stages.estimate.source import estimate_model
from lab.estimate_check import (
    Case,
    cuda_truth_cases,
    cuda_truth_estimate_args,
    cuda_truth_header,
    format_rows,
    run_case,
    within,
)
from lab.tinymodels import write_gguf

FIXTURES = REPO.parent / "shared" / "fixtures" / "real"

CASES = [
    Case("llama-f32-1mb-defaults", "llama", {"n_layer": 2, "n_embd": 128, "n_head": 4, "n_head_kv": 2, "n_ff": 384,
                                             "n_vocab": 512, "file_type": "f32"}),
    Case("llama-q8-ctx8k-np2-split", "llama", {"n_layer": 4, "n_embd": 256, "n_head": 8, "n_head_kv": 2,
                                               "n_ff": 512, "file_type": "q8_0"},
         ctx=8192, parallel=2, kv_unified=False, cache_type_k="q8_0", cache_type_v="q8_0"),
    Case("llama-f16-40mb-q4cache-ub256", "llama", {"n_layer": 8, "n_embd": 512, "n_head": 8, "n_head_kv": 4,
                                                   "n_ff": 1024, "n_vocab": 8000, "file_type": "f16"},
         ctx=16384, parallel=1, cache_type_k="q4_0", cache_type_v="q4_0", ubatch=256),
    Case("llama-iq4nl-k-no-fa", "llama", {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_head_kv": 4, "n_ff": 512,
                                          "file_type": "q4_0"},
         ctx=4096, parallel=1, cache_type_k="iq4_nl", cache_type_v="f16", flash_attn="off"),
    Case("qwen3moe-q8-np4-unified", "qwen3moe", {"n_layer": 4, "n_embd": 256, "n_head": 8, "n_head_kv": 4,
                                                 "n_expert": 8, "n_expert_used": 2, "n_ff_exp": 128,
                                                 "file_type": "q8_0"},
         ctx=4096, parallel=4, kv_unified=True),
    Case("qwen3moe-f16-np3-q8k", "qwen3moe", {"n_layer": 8, "n_embd": 512, "n_head": 8, "n_head_kv": 2,
                                              "n_expert": 16, "n_expert_used": 4, "n_ff_exp": 256,
                                              "n_vocab": 4000, "file_type": "f16"},
         ctx=8192, parallel=3, kv_unified=False, cache_type_k="q8_0", cache_type_v="f16"),
    Case("qwen3moe-32k-vocab-ub1024", "qwen3moe", {"n_layer": 4, "n_embd": 512, "n_head": 8, "n_head_kv": 4,
                                                   "n_expert": 8, "n_expert_used": 2, "n_ff_exp": 256,
                                                   "n_vocab": 32000, "file_type": "q8_0"},
         ctx=2048, parallel=1, ubatch=1024),
    Case("gemma3-swa-q8-np1", "gemma3", {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512,
                                         "sliding_window": 256, "swa_pattern": 2, "file_type": "q8_0"},
         ctx=8192, parallel=1),
    Case("gemma3-swa-32k-np4-q8cache", "gemma3", {"n_layer": 12, "n_embd": 512, "n_head": 8, "n_head_kv": 4,
                                                  "n_ff": 1024, "n_vocab": 4000, "n_ctx_train": 32768,
                                                  "sliding_window": 512, "swa_pattern": 6, "file_type": "f16"},
         ctx=32768, parallel=4, kv_unified=True, cache_type_k="q8_0", cache_type_v="q8_0"),
    Case("gemma3-swa-np2-split-q5", "gemma3", {"n_layer": 6, "n_embd": 256, "n_head": 4, "n_head_kv": 4,
                                               "n_ff": 512, "sliding_window": 128, "swa_pattern": 3,
                                               "file_type": "q4_0"},
         ctx=6000, parallel=2, kv_unified=False, cache_type_k="q5_1", cache_type_v="q5_0"),
    Case("gemma3-defaults-train-ctx", "gemma3", {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_head_kv": 2,
                                                 "n_ff": 512, "n_ctx_train": 8192, "sliding_window": 512,
                                                 "swa_pattern": 2, "file_type": "q8_0"}),
    Case("llama-f16-600mb", "llama", {"n_layer": 4, "n_embd": 2048, "n_head": 16, "n_head_kv": 4, "n_ff": 5632,
                                      "n_vocab": 32000, "file_type": "f16"},
         ctx=8192, parallel=1, ubatch=512),
]

# (b) Which engine wrote each log, whether the product runs that engine family at a comparable
# version, and — when not — why its KV differs from what the pinned engines allocate.
COMPARABLE_LOGS = {
    "upstream": (
        "llamalog-devstral-small2-24b-256-f16-gb10-ngl0-cpu-mapped.txt",
        "llamalog-mainline-qwen3-235b-a22b-16k-q8_0-2x3090.txt",
        "llamalog-mainline-qwen3-30b-a3b-16k-f16-4090+5090-cpu-experts-llama-cli.txt",
    ),
    "ik": (
        "llamalog-ik-deepseek-v3-8k-mla-f16-4gpu-partial-offload.txt",
        "llamalog-ik-gemma3-27b-131072-f16-cpu-only-arm-full-swa-cache.txt",
        "llamalog-ik-gemma3-27b-32k-f16-a6000.txt",
        "llamalog-ik-llama3.1-8b-1k-k-iq4_nl-v-f16-windows-perplexity.txt",
        "llamalog-ik-nemotron-ultra-253b-12k-k-q8_0-v-q4_0-4gpu.txt",
        "llamalog-ik-qwen3-235b-a22b-16k-q8_0-2x3090-kv-on-host.txt",
        "llamalog-ik-qwen3-235b-a22b-32k-f16-5090+4090-cpu-offload-windows.txt",
        "llamalog-ik-qwen3-235b-a22b-32k-q8_0-2x3090-collapsed-spaces-oom.txt",
        "llamalog-ik-qwen3-32b-8k-f16-2xT4-sm-row-annotated.txt",
    ),
}
LOG_ENGINES: dict[str, tuple[str, bool, str]] = {
    name: (family, True, "") for family, names in COMPARABLE_LOGS.items() for name in names
} | {
    "llamalog-mainline-deepseek-v3-16k-f16-mla-4gpu-cpu-override-tensor.txt": (
        "upstream", False,
        ("mainline build 5331 (May 2025) cached MLA as K (512+64) plus V (512); current upstream caches K only "
         "(and GGUFs converted since store key_length_mla), so the pinned engine needs 47% less")),
}


def part_a(folder: Path) -> bool:
    from lab.engine_build import build

    server = build() / "llama-server"
    rows = []
    for case in CASES:
        rows.append(run_case(server, case, folder))
        print(format_rows(rows[-1:]).splitlines()[-1], flush=True)
    print("\n(a) real CPU llama-server 0c1e570 at -lv 4 vs estimate (MiB)\n")
    print(format_rows(rows))
    return all(r.passed for r in rows)


def part_b(folder: Path) -> bool:
    print("\n(b) public load logs vs estimate from a header-only GGUF of the same model (KV, MiB; target 2%)\n")
    print(f"{'log':<72}{'engine':>9}{'est':>10}{'actual':>10}{'diff':>8}  result")
    ok = True
    others = []
    for path in sorted(FIXTURES.glob("llamalog-*.txt")):
        log = parse_log(path.read_text(errors="replace"))
        engine, targeted, reason = LOG_ENGINES.get(path.name, ("upstream", False, "not classified"))
        gguf = write_gguf(folder / f"{path.stem}.gguf", log.arch, header_metadata(log), [], header_only=True)
        settings = context_settings(log)
        settings["engine"] = engine
        actual = log.total("KV") or log.kv_self_mib or 0.0
        est = estimate_model(str(gguf), **settings).kv.total_bytes / 2**20
        diff = (est - actual) / actual * 100 if actual else float("nan")
        passed = within(est, actual, (0.02, 0.0))
        verdict = ("PASS" if passed else "FAIL") if targeted else "other"
        ok &= passed or not targeted
        print(f"{path.name[:71]:<72}{engine:>9}{est:>10.1f}{actual:>10.1f}{diff:>7.1f}%  {verdict}")
        if not targeted:
            others.append(f"  {path.name}: {reason}" + (f" (within 2% anyway: {diff:+.1f}%)" if passed else ""))
    print("\nnot targeted:\n" + "\n".join(others))
    return ok


# (c) Published configs. Gemma 4 26B-A4B: config.json text_config of google/gemma-4-26B-A4B-it as
# quoted in public code (e.g. the 26B-A4B fixtures found with the code search: hidden_size 2816,
# 30 layers, 16 heads, sliding layers 8 KV heads x 256, full layers (every 6th: 5, 11, ..., 29)
# 2 KV heads x 512 with K=V, sliding_window 1024, vocab 262144). Qwen3.6-35B-A3B (qwen3_5_moe):
# 40 layers, full attention every 4th, 16 heads, 2 KV heads x 256, gated-delta-net layers with 16
# key / 32 value heads of 128, conv kernel 4, 256 experts top-8, one MTP layer.
GEMMA4 = {
    "context_length": 262144, "embedding_length": 2816, "block_count": 30, "attention.head_count": 16,
    "attention.head_count_kv": [2 if (il + 1) % 6 == 0 else 8 for il in range(30)],
    "attention.key_length": 512, "attention.value_length": 512, "attention.key_length_swa": 256,
    "attention.value_length_swa": 256, "attention.sliding_window": 1024,
    "attention.sliding_window_pattern": [(il + 1) % 6 != 0 for il in range(30)],
    "expert_count": 128, "expert_used_count": 8, "vocab_size": 262144,
}
QWEN36 = {
    "context_length": 262144, "embedding_length": 2048, "block_count": 41, "nextn_predict_layers": 1,
    "attention.head_count": 16, "attention.head_count_kv": 2, "attention.key_length": 256,
    "attention.value_length": 256, "full_attention_interval": 4, "ssm.conv_kernel": 4, "ssm.state_size": 128,
    "ssm.group_count": 16, "ssm.time_step_rank": 32, "ssm.inner_size": 4096, "expert_count": 256,
    "expert_used_count": 8, "vocab_size": 248320,
}


def _header(folder: Path, arch: str, keys: dict) -> Path:
    return write_gguf(folder / f"{arch}-published.gguf", arch, {f"{arch}.{k}": v for k, v in keys.items()}, [],
                      header_only=True)


def part_c(folder: Path) -> bool:
    print("\n(c) the kit's figures (DESIGN.md) vs estimates from published configs\n")
    gemma = _header(folder, "gemma4", GEMMA4)
    kit = estimate_model(str(gemma), ctx=32768, parallel=1, cache_type_k="q8_0", cache_type_v="q8_0", ubatch=1024)
    default = estimate_model(str(gemma), ctx=32768, cache_type_k="q8_0", cache_type_v="q8_0", ubatch=1024)
    ik = estimate_model(str(gemma), ctx=4096, engine="ik")
    ik_train = estimate_model(str(gemma), engine="ik")  # no -c: the 262144-token training context
    print(f"Gemma 4 26B-A4B KV at 32k q8_0, kit flags (-np 1 -ub 1024): {kit.kv.total_bytes / 2**30:.2f} GiB "
          f"(full layers {kit.kv.layers - kit.kv.swa_layers} x {kit.kv.cells} cells, SWA {kit.kv.swa_layers} x "
          f"{kit.kv.swa_cells} cells); with 4 unified slots: {default.kv.total_bytes / 2**30:.2f} GiB; kit: ~1.3 GiB")
    print(f"  same model on ik_llama.cpp (no iSWA), f16: {ik.kv.total_bytes / 2**30:.2f} GiB KV at 4k, "
          f"{ik_train.kv.total_bytes / 1e9:.1f} GB ({ik_train.kv.total_bytes / 2**30:.1f} GiB) at its training context; kit: ik 'tries to allocate ~56 GB'")
    qwen = _header(folder, "qwen35moe", QWEN36)
    kit_kb = {"f16": 22.5, "q8_0": 17.0, "q4_0": 11.9}
    for cache, measured in kit_kb.items():
        result = estimate_model(str(qwen), ctx=131072, parallel=1, cache_type_k=cache, cache_type_v=cache)
        main = result.kv.bytes_per_token
        mtp = main // 10  # the MTP draft context caches its one attention layer
        print(f"Qwen3.6 35B-A3B KV bytes/token {cache:>5}: main context {main / 1000:.1f} kB + MTP head "
              f"{mtp / 1000:.1f} kB = {(main + mtp) / 1000:.1f} kB; kit measured ~{measured} kB; recurrent state "
              f"{result.kv.recurrent_bytes / 2**20:.1f} MiB per slot")
    return True


def part_d(folder: Path) -> bool:
    from tests.cli import invoke  # the command itself, as a user runs it

    cases = cuda_truth_cases()
    if not cases:
        print("\n(d) ../shared/fixtures/gpu-h100-580/cuda-truth is not beside this clone: skipped")
        return True
    print("\n(d) CUDA llama-server 0c1e570 on an H100 (driver 580) vs controller estimate --gpus 0 (MiB)\n")
    head = (f"{'case':<44}| {'weights est':>11}{'actual':>8} | {'KV est':>7}{'actual':>8} | {'CUDA0 est':>9}"
            f"{'actual':>8} | {'CUDA_Host est':>13}{'actual':>8} | {'GPU total':>9}{'actual':>8} | result")
    print(head + "\n" + "-" * len(head))
    ok = True
    for path in cases:
        recorded = json.loads(path.read_text())
        case, truth = recorded["case"], recorded["truth"]
        log = parse_log(path.with_suffix(".log").read_text(errors="replace"))
        gguf = cuda_truth_header(case["model"], folder / f"{case['name']}.gguf")
        out = invoke("estimate", str(gguf), "--json", *cuda_truth_estimate_args(case))
        devices = {d["name"]: d for d in json.loads(out.output)["devices"]}
        gpu, host = devices["CUDA0"], devices["CPU"]
        weights = (gpu["weights_mib"] + host["weights_mib"], sum(truth["model_buffers"].values()))
        kv = (gpu["kv_mib"] + host["kv_mib"], log.total("KV"))
        cuda0 = (gpu["compute_mib"], truth["compute_buffers"]["CUDA0"])
        pinned = (host["compute_mib"], truth["compute_buffers"].get("CUDA_Host", 0.0))
        total = (gpu["weights_mib"] + gpu["kv_mib"] + gpu["compute_mib"],
                 truth["model_buffers"]["CUDA0"] + log.buffers["KV"].get("CUDA0", 0.0) + cuda0[1])
        checks = {"weights": within(*weights, (0.01, 0.0)), "kv": within(*kv, (0.01, 0.0)),
                  "CUDA0": within(*cuda0, (0.10, 32.0)), "CUDA_Host": within(*pinned, (0.10, 32.0)),
                  "total": total[0] >= total[1] - 0.01}
        failed = [k for k, passed in checks.items() if not passed]
        ok &= not failed
        print(f"{case['name']:<44}| {weights[0]:>11.2f}{weights[1]:>8.2f} | {kv[0]:>7.2f}{kv[1]:>8.2f} | "
              f"{cuda0[0]:>9.2f}{cuda0[1]:>8.2f} | {pinned[0]:>13.2f}{pinned[1]:>8.2f} | {total[0]:>9.2f}"
              f"{total[1]:>8.2f} | " + ("PASS" if not failed else "FAIL (" + ", ".join(failed) + ")"))
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["a", "b", "c", "d"])
    parser.add_argument("--dir", type=Path, default=None, help="where generated models are kept between runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="est-bench-") as tmp:
        folder = args.dir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        ok = True
        if args.only in (None, "a"):
            ok &= part_a(folder)
        if args.only in (None, "b"):
            ok &= part_b(folder)
        if args.only in (None, "c"):
            ok &= part_c(folder)
        if args.only in (None, "d"):
            ok &= part_d(folder)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
