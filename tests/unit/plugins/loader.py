"""The collection's modules as tests use them: loaded by file, as Ansible does (they are not a package), or run as a
script with a JSON args file, as Ansible's debug path runs them; and the tiny model server the checks talk to."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
PLUGINS = ROOT / "ansible_collections/v100box/llm/plugins" / "modules"


def load_module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, PLUGINS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def module_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment in which a module run as a script imports the collection's module_utils by their full name
    (``ansible_collections.v100box.llm.plugins.module_utils``), as Ansible's payload provides them on a box."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def module_command(name: str, folder: Path, args: dict[str, Any], args_name: str = "args.json") -> list[str]:
    """The command that runs module ``name`` with ``args`` (written to ``folder/args_name``)."""
    args_file = folder / args_name
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    return [sys.executable, str(PLUGINS / f"{name}.py"), str(args_file)]


def run_module(name: str, folder: Path, args: dict[str, Any], timeout: float = 120,
               env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Module ``name`` run with ``args``: the finished process and the JSON it answered."""
    done = subprocess.run(module_command(name, folder, args), capture_output=True, text=True, timeout=timeout,
                          check=False, env=module_env(env))
    try:
        return done, json.loads(done.stdout)
    except ValueError:
        raise AssertionError(f"{name} answered no JSON:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}") from None


@contextmanager
def tiny_server(llama_server: Path, folder: Path, key: str, *flags: str) -> Iterator[Any]:
    """The CPU llama-server serving a tiny random model as ``tiny`` with API key ``key``, and ``flags``."""
    from lab import tinymodels
    from lab.llama_server import serve

    model = tinymodels.write_model(folder / "tiny.gguf", "llama", file_type="q8_0")
    with serve(llama_server, model, ["--alias", "tiny", "--api-key", key, *flags]) as running:
        yield running
