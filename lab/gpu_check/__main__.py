"""``python -m lab.gpu_check [--cpu] [--out DIR] ...`` runs the check; ``python -m lab.gpu_check prepare DIR``
makes the bundle an offline GPU machine needs (see lab/gpu_check/bundle.py)."""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if argv[:1] == ["prepare"]:
        import argparse

        from lab.gpu_check.bundle import prepare

        parser = argparse.ArgumentParser(prog="python -m lab.gpu_check prepare")
        parser.add_argument("dest", type=Path, nargs="?", default=Path("out/gpu-check-bundle"))
        parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python, for compiled wheels")
        ns = parser.parse_args(argv[1:])
        print(prepare(ns.dest, python_version=ns.python_version))
        return 0
    from lab.gpu_check.run import main_args, run_check

    return run_check(main_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
