"""Load a module of plugins/modules by file, as Ansible does (they are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

PLUGINS = Path(__file__).resolve().parents[3] / "ansible_collections/v100box/llm/plugins" / "modules"


def load_module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, PLUGINS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
