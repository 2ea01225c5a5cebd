"""Bytes pulled from upstream by a 3-box fleet, with and without the fleet's LAN cache (issue 12).

Three systemd targets (lab.target, sharing this machine's network) fetch the lab's engine pack and model with
the download roles of playbooks/site.yml (lan_cache, llama_engine, gguf_model), from the inventory the
controller renders (probe, plan, render of each box), all three at once (forks 3). The upstream is the lab's
file server, which counts the body bytes it sends and the requests it answers. Three runs:

1. no cache: every box fetches from upstream (mirror.models / mirror.engines);
2. cache, cold: c1 runs the cache (nginx from Debian's packages, slices of --slice), every box fetches through it;
3. cache, warm: the boxes' files are removed and fetched again through the cache.

Between runs the boxes' model file and engine folder are removed. Target: with the cache each file leaves
upstream exactly once (run 2 sends the files' total size, run 3 sends nothing).

    .venv/bin/python benchmarks/lan_cache_bench.py [--slice 1m]

Takes about two minutes here (three targets; nginx and libgomp1 come from Debian's mirrors).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.actions.provision import prepare  # noqa: E402
from controller.model.fleet import load_fleet  # noqa: E402
from controller.stages.render import read_rendered  # noqa: E402
from controller.stages.runner import run_playbook  # noqa: E402
from lab import image as lab_image  # noqa: E402
from lab.fileserver import FileServer  # noqa: E402
from lab.site import MODEL_REPO, PACK_NAME, build_site, mirror  # noqa: E402
from lab.target import Target, free_port, role_play  # noqa: E402

BOXES = ("c1", "c2", "c3")
PLAY = role_play("Fetch with the download roles of playbooks/site.yml", ["lan_cache", "llama_engine", "gguf_model"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slice", default="1m", help="the cache's slice size (nginx size; the role's default 16m)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lan-cache-bench-"))
    root = work / "site"
    catalog = build_site(root)
    model_name = yaml.safe_load(catalog.read_text())["models"]["tiny-llama"]["file"]
    files = {"model": root / MODEL_REPO / model_name, "pack": root / "engines" / PACK_NAME}
    (work / "play.yml").write_text(PLAY)
    image = lab_image.ensure_image()
    targets = []
    try:
        with FileServer(root) as server:
            for _ in BOXES:
                targets.append(Target.start(image=image))
            boxes = {name: {**target.fleet_entry(), "models": [{"id": "tiny-llama", "ctx": 2048}]}
                     for name, target in zip(BOXES, targets, strict=True)}
            cache = {"host": "c1", "address": "127.0.0.1", "bind": "127.0.0.1", "port": free_port(),
                     **mirror(server.url)}
            plain = {name: {**box, "mirror": mirror(server.url)} for name, box in boxes.items()}
            cached_boxes = {**boxes, "c1": {**boxes["c1"], "vars": {"lan_cache_slice": args.slice}}}
            rows = []
            for label, fleet_body in (("no cache", {"boxes": plain}),
                                      ("cache, cold", {"boxes": cached_boxes, "cache": cache}),
                                      ("cache, warm", {"boxes": cached_boxes, "cache": cache})):
                inventory = work / label.replace(", ", "-").replace(" ", "-")
                path = work / f"{inventory.name}.yml"
                path.write_text(yaml.safe_dump({"catalogs": [str(catalog)], **fleet_body}))
                fleet = load_fleet(path)
                for name in BOXES:
                    prepare(fleet, name, inventory)
                model_dir = read_rendered((inventory / "host_vars" / "c1.yml").read_text())["gguf_model_dir"]
                for target in targets:  # every box starts without the files
                    target.exec(["rm", "-rf", f"{model_dir}/{model_name}", "/opt/llama/cpu"])
                server.reset_counters()
                started = time.monotonic()
                result = run_playbook(str(work / "play.yml"), inventory=inventory, forks=3, raise_on_failure=False)
                seconds = time.monotonic() - started
                if result.status != "successful":
                    print(f"{label}: run failed: {[f.message for f in result.failed]}", file=sys.stderr)
                    return 1
                requests = Counter(seen.path.rsplit("/", 1)[-1] for seen in server.requests)
                rows.append((label, server.bytes_sent, requests[model_name], requests[PACK_NAME], seconds))
    finally:
        for target in targets:
            target.stop()
    sizes = {key: path.stat().st_size for key, path in files.items()}
    total = sum(sizes.values())
    print(f"files: model {model_name} {sizes['model']} B, engine pack {PACK_NAME} {sizes['pack']} B "
          f"(together {total} B); 3 boxes, slice {args.slice}")
    print(f"{'run':<12} {'upstream bytes':>15} {'x files':>8} {'model GETs':>11} {'pack GETs':>10} {'run s':>7}")
    for label, sent, model_gets, pack_gets, seconds in rows:
        print(f"{label:<12} {sent:>15} {sent / total:>8.2f} {model_gets:>11} {pack_gets:>10} {seconds:>7.1f}")
    cold, warm = rows[1][1], rows[2][1]
    verdict = "met" if cold == total and warm == 0 else "NOT met"
    print(f"target (each file from upstream exactly once with the cache): {verdict}")
    return 0 if verdict == "met" else 1


if __name__ == "__main__":
    sys.exit(main())
