"""A target with a draft model on the real CPU llama-server: memory estimate against its buffers, and drafting.

For generated pairs of growing size (the draft shares the target's vocabulary and tied embedding
matrix, so it guesses what the target picks), the server is started with the planner's draft flags
(``--spec-type draft-simple --model-draft ... --spec-draft-n-max 5``):

* memory: ``controller estimate TARGET --draft DRAFT`` against the KV, weights and compute buffers the
  server reports for both models together (targets as in estimate_accuracy.py: KV and weights within
  1% or 1 MiB, compute within 10% or 32 MiB);
* drafting: tokens/s of one 128-token greedy completion with and without the draft, and how many
  drafted tokens the target accepted (``/completion`` timings).

The speed column says nothing about a V100: generated weights on two CPU cores only show that the
pair drafts and the acceptance is counted. The seed's ~55 -> ~100 tok/s is a V100 figure.

    flock /tmp/v100-heavy.lock .venv/bin/python benchmarks/draft_pair.py

Exit status 1 if a memory row misses its target or a pair never drafts.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from controller.stages.estimate.llamalog import parse_log
from controller.stages.estimate.source import estimate_draft, estimate_model, with_draft
from lab.engine_build import build
from lab.estimate_check import COMPUTE_TOL, KV_TOL, WEIGHTS_TOL, within
from lab.llama_server import serve
from lab.tinymodels import write_model

PAIRS = [  # (name, shared shape, target layers/ffn, draft layers/ffn)
    ("tiny-f32", {"n_embd": 128, "n_head": 4, "n_head_kv": 2, "n_vocab": 400, "file_type": "f32"}, (4, 512), (1, 256)),
    ("small-f16", {"n_embd": 512, "n_head": 8, "n_head_kv": 4, "n_vocab": 2000, "file_type": "f16"}, (8, 1536),
     (1, 512)),
    ("mid-q8", {"n_embd": 1024, "n_head": 16, "n_head_kv": 4, "n_vocab": 4000, "file_type": "q8_0"}, (12, 3072),
     (2, 1024)),
]
CTX = 4096


def _complete(url: str) -> dict:
    return httpx.post(f"{url}/completion", timeout=300,
                      json={"prompt": "the quick brown fox jumps over the lazy dog", "n_predict": 128,
                            "temperature": 0, "cache_prompt": False}).json()["timings"]


def main() -> int:
    server = build() / "llama-server"
    failed = False
    head = (f"{'pair':<10}{'MiB t/d':>12} | {'KV est':>8}{'actual':>8} | {'weights est':>12}{'actual':>8} | "
            f"{'compute est':>12}{'actual':>8} | {'tok/s alone':>11}{'with draft':>11}{'accepted':>12}")
    print(head)
    print("-" * len(head))
    with tempfile.TemporaryDirectory(prefix="draft-bench-") as tmp:
        folder = Path(tmp)
        for name, shape, (t_layers, t_ff), (d_layers, d_ff) in PAIRS:
            common = {**shape, "tied_embeddings": True, "seed": 11}
            target = write_model(folder / f"{name}-t.gguf", "llama", n_layer=t_layers, n_ff=t_ff, **common)
            draft = write_model(folder / f"{name}-d.gguf", "llama", n_layer=d_layers, n_ff=d_ff, **common)
            base = ["-c", str(CTX), "-np", "1"]
            spec = ["--spec-type", "draft-simple", "--model-draft", str(draft), "--spec-draft-n-max", "5",
                    "--spec-draft-n-min", "0"]
            with serve(server, target, base) as running:
                alone = _complete(running.url)
            with serve(server, target, base + spec) as running:
                paired = _complete(running.url)
                log = parse_log(running.log())
            options = {"ctx": CTX, "parallel": 1, "kv_unified": False}
            data = with_draft(estimate_model(str(target), **options).to_json(),
                              estimate_draft(str(draft), [], [], **options))
            kv = data["kv"]["total_mib"] + data["draft"]["kv"]["total_mib"]
            weights = data["weights"]["total_mib"] + data["draft"]["weights"]["total_mib"]
            compute = data["compute"]["total_mib"] + data["draft"]["compute"]["total_mib"]
            ok = (within(kv, log.total("KV"), KV_TOL) and within(weights, log.total("model"), WEIGHTS_TOL)
                  and within(compute, log.total("compute"), COMPUTE_TOL) and paired.get("draft_n", 0) > 0)
            failed |= not ok
            sizes = f"{target.stat().st_size / 2**20:.0f}/{draft.stat().st_size / 2**20:.0f}"
            accepted = f"{paired.get('draft_n_accepted', 0)}/{paired.get('draft_n', 0)}"
            print(f"{name:<10}{sizes:>12} | {kv:>8.2f}{log.total('KV'):>8.2f} | {weights:>12.2f}"
                  f"{log.total('model'):>8.2f} | {compute:>12.2f}{log.total('compute'):>8.2f} | "
                  f"{alone['predicted_per_second']:>11.1f}{paired['predicted_per_second']:>11.1f}{accepted:>12}"
                  + ("" if ok else "  FAIL"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
