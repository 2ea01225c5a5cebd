"""How long the first request for an on-demand model waits on a real GPU: llama-server's router mode loading a
13 GB model whose file is not in the page cache (issue 24: Claude Code waits 360 s for response headers).

On a GPU machine with nvcc, CMake and ninja (the device machines here: the prepared bundle carries the source):

    python3 -m lab.gpu_check.router_load --bundle out/gpu-check-bundle --work /tmp/router-load --out "$OUT"

It builds the CUDA server of the test engine's commit for the card (``lab.gpu_check.build``) while it writes two
models with ``lab.tinymodels`` (a 13.5 GB f16 llama of a 7B shape and a tiny one), starts the router with both in
its preset, at most one loaded, the key file in the environment as the product's unit gives it, then times: the
tiny model's first turn (the CUDA start), the big one's with its file dropped from the page cache (the disk read
included), the tiny one again (the big one unloaded), the big one again from the page cache; and how long a plain
read of the big file takes once dropped from the cache. Writes ``router-load.json`` and the router's log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from lab.gpu_check import build

KEY = "router-load-key-0123456789abcdef"
BIG = {"n_layer": 38, "n_embd": 4096, "n_head": 32, "n_head_kv": 8, "n_ff": 11008, "n_vocab": 4096,
       "file_type": "f16"}


def _drop_from_cache(path: Path) -> None:
    """Ask the kernel to forget the file's pages (clean pages go at once; the file was synced when written)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_seconds(path: Path) -> float:
    _drop_from_cache(path)
    started = time.monotonic()
    with path.open("rb") as handle:
        while handle.read(64 << 20):
            pass
    return time.monotonic() - started


def _turn(port: int, model: str, timeout: float = 900) -> dict[str, float]:
    """One streamed chat turn: seconds to the response headers and to the first token."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                       "stream": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=timeout) as response:
        headers = time.monotonic() - started
        for raw in response:
            line = raw.decode(errors="replace")
            if line.startswith("data: ") and '"content"' in line:
                return {"headers_s": round(headers, 3), "first_token_s": round(time.monotonic() - started, 3)}
    return {"headers_s": round(headers, 3), "first_token_s": -1.0}


def _statuses(port: int) -> dict[str, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return {item["id"]: item["status"]["value"] for item in json.load(response)["data"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--port", type=int, default=18411)
    parser.add_argument("--server", type=Path, help="a llama-server to use instead of building one (a dry run)")
    parser.add_argument("--big-layers", type=int, default=BIG["n_layer"], help="layers of the big model")
    args = parser.parse_args()
    work, out = args.work, args.out
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    source = build.Source(args.bundle / "llama.cpp-src.tar.xz")
    built: dict[str, object] = {}
    if args.server:
        arch, commands, build_dir = "none", [], args.server.parent.parent
        built["server"] = str(args.server)
    else:
        arch = build.arch_from_compute_cap(subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True,
            check=True).stdout)
        commands, build_dir = build.start_build(arch, source, work, out / "build.log", os.cpu_count() or 8,
                                                build.find_nvcc() or "nvcc")

    def run_build() -> None:
        started = time.monotonic()
        with (out / "build.log").open("a") as log:
            for command in commands:
                done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
                if done.returncode:
                    built["error"] = f"{command[:3]} exited {done.returncode}"
                    return
        built["seconds"] = round(time.monotonic() - started, 1)

    builder = threading.Thread(target=run_build)
    builder.start()
    sys.path.insert(0, str(build.source_gguf_path(source, work)))
    from lab import tinymodels  # needs gguf, from the source's gguf-py

    started = time.monotonic()
    big = tinymodels.write_model(work / "big-7b-f16.gguf", "llama", name="big", **{**BIG, "n_layer": args.big_layers})
    small = tinymodels.write_model(work / "small.gguf", "llama", n_embd=128, n_head=4, n_head_kv=2, n_ff=256,
                                   file_type="q8_0", name="small", seed=3)
    written = round(time.monotonic() - started, 1)
    builder.join()
    result: dict[str, object] = {"arch": arch, "build": built, "model_write_s": written,
                                 "big_bytes": big.stat().st_size}
    if "error" in built:
        (out / "router-load.json").write_text(json.dumps(result, indent=2))
        return 1
    server = args.server or build_dir / "bin" / build.TARGET
    if shutil.which("nvidia-smi"):
        result["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                        "--format=csv,noheader"], capture_output=True, text=True,
                                       check=False).stdout.strip()
    key = work / "api.key"
    key.write_text(KEY + "\n")
    preset = work / "preset.ini"
    preset.write_text("version = 1\n\n"
                      f"[big]\nmodel = {big}\nctx-size = 4096\nn-gpu-layers = 99\nflash-attn = on\njinja = true\n\n"
                      f"[small]\nmodel = {small}\nctx-size = 2048\nn-gpu-layers = 99\njinja = true\n")
    env = {**os.environ, "LLAMA_ARG_API_KEY_FILE": str(key)}
    with (out / "router.log").open("w") as log:
        router = subprocess.Popen([str(server), "--models-preset", str(preset), "--models-max", "1", "--host",
                                   "127.0.0.1", "--port", str(args.port), "--no-slots"], stdout=log,
                                  stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    _statuses(args.port)
                    break
                except OSError:
                    if time.monotonic() > deadline or router.poll() is not None:
                        raise
                    time.sleep(0.2)
            steps = []
            for label, model, cold in (("small, first (CUDA start)", "small", False),
                                       ("big, file not in the page cache", "big", True),
                                       ("small, big unloaded", "small", False),
                                       ("big, file in the page cache", "big", False),
                                       ("big, loaded", "big", False)):
                if cold:
                    _drop_from_cache(big)
                step = {"step": label, **_turn(args.port, model), "loaded_after": _statuses(args.port)}
                steps.append(step)
                print(json.dumps(step), flush=True)
            result["steps"] = steps
        finally:
            router.terminate()
            try:
                router.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(router.pid, 9)
    result["plain_read_s"] = round(_read_seconds(big), 2)
    result["disk"] = shutil.disk_usage(work)._asdict()
    (out / "router-load.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
