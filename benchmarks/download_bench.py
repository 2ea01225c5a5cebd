"""How much the gguf_download module costs over curl, and how much a resumed download re-fetches.

(a) One file (1 GiB of random bytes by default) from the local file server, 3 runs each, medians:
    curl -s -o; curl followed by sha256sum (what a shell needs to verify); the module's download()
    (transfer + SHA-256 in one pass); the module's ensure() (the whole module: + fsync, rename, marker).
(b) A download cut at 50% by the server, then resumed: total bytes sent / file size.

    .venv/bin/python benchmarks/download_bench.py [--size-mib 1024] [--runs 3] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lab.fileserver import FileServer


def load_module() -> Any:
    spec = importlib.util.spec_from_file_location("gguf_download", REPO / "ansible_collections/v100box/llm/plugins/modules/gguf_download.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def make_file(path: Path, size: int) -> str:
    """Write ``size`` random bytes once; return their sha256."""
    digest = hashlib.sha256()
    with open(path, "wb") as out:
        for _ in range(0, size, 64 << 20):
            block = os.urandom(min(64 << 20, size - out.tell()))
            digest.update(block)
            out.write(block)
    return digest.hexdigest()


def median_time(action: Callable[[], object], cleanup: Callable[[], None], runs: int) -> float:
    """Median wall time; dirty pages are flushed between runs, outside the timing."""
    times = []
    for _ in range(runs):
        cleanup()
        os.sync()
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    cleanup()
    return statistics.median(times)


def hash_rate(seconds: float = 1.0) -> float:
    """In-memory SHA-256 throughput in GiB/s: the floor any verifying download sits on."""
    block, digest, done = os.urandom(16 << 20), hashlib.sha256(), 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        digest.update(block)
        done += len(block)
    return done / (time.perf_counter() - started) / 2**30


def print_table(title: str, rows: list[tuple[str, float]], size: int) -> None:
    print(title)
    print(f"  {'method':42} {'median s':>9} {'GiB/s':>7} {'x curl':>7}")
    for name, seconds in rows:
        print(f"  {name:42} {seconds:9.2f} {size / seconds / 2**30:7.2f} {seconds / rows[0][1]:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--rate-mib", type=float, default=112.0, help="paced link for the second table (MiB/s)"
    )
    parser.add_argument("--dir", default=None, help="scratch folder (default: the system temp folder)")
    args = parser.parse_args()
    gd = load_module()
    size = args.size_mib << 20
    print(
        f"{args.size_mib} MiB file from 127.0.0.1, median of {args.runs} runs; cpus: {os.cpu_count()}, "
        f"load: {os.getloadavg()[0]:.2f}; in-memory sha256: {hash_rate():.2f} GiB/s"
    )

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="download-bench-") as scratch:
        root, out = Path(scratch, "root"), Path(scratch, "out")
        (root / "org" / "repo").mkdir(parents=True)
        out.mkdir()
        sha256 = make_file(root / "org" / "repo" / "model.gguf", size)
        dest = out / "model.gguf"

        def cleanup() -> None:
            for name in os.listdir(out):
                os.remove(out / name)

        with FileServer(root) as server:
            url = server.hub_url("org", "repo", "model.gguf")
            params = {
                "url": url,
                "dest": str(dest),
                "sha256": sha256,
                "size": size,
                "token": None,
                "headers": {},
                "timeout": 60,
            }

            def curl() -> None:
                subprocess.run(["curl", "-s", "-o", str(dest), url], check=True)

            def curl_and_sha256sum() -> None:
                curl()
                got = subprocess.run(["sha256sum", str(dest)], check=True, capture_output=True, text=True)
                assert got.stdout.split()[0] == sha256

            def module_download() -> None:
                assert gd.download(url, str(dest), {}, 60, size).sha256 == sha256

            def module_ensure() -> None:
                assert gd.ensure(params)["changed"]

            def timed(action: Callable[[], None]) -> float:
                return median_time(action, cleanup, args.runs)

            print_table(
                "(a) loopback, as fast as sendfile goes",
                [
                    ("curl -s -o", timed(curl)),
                    ("curl -s -o && sha256sum", timed(curl_and_sha256sum)),
                    ("module download() (sha256 in the same pass)", timed(module_download)),
                    ("module ensure() (+ fsync, rename, marker)", timed(module_ensure)),
                ],
                size,
            )

            server.rate = args.rate_mib * 2**20
            print_table(
                f"(a') paced at {args.rate_mib:g} MiB/s (~{args.rate_mib * 2**20 * 8 / 1e9:.2f} Gbit/s link)",
                [
                    ("curl -s -o", timed(curl)),
                    ("module ensure() (+ fsync, rename, marker)", timed(module_ensure)),
                ],
                size,
            )
            server.rate = None

            server.reset_counters()
            server.drop_after = size // 2
            try:
                gd.ensure(params)
                raise SystemExit("the server did not cut the transfer")
            except gd.DownloadError:
                pass
            server.drop_after = None
            resumed = gd.ensure(params)
            cleanup()
            print(
                f"(b) cut at 50%, rerun resumed_from={resumed['resumed_from']}: bytes sent / file size = "
                f"{server.bytes_sent / size:.4f} (target <= 1.02)"
            )


if __name__ == "__main__":
    main()
