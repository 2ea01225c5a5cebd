"""What a role writes, seen without a box: one play on localhost with Ansible's own template engine.

The gateway's lab and tests render roles/llm_gateway's configuration this way, the GPU check the llama_service
unit: the play reads the role's ``defaults/main.yml`` and ``vars/main.yml`` (as the role would), the caller's
variables come over them as extra vars (as an inventory's would), and the collection's filters
(``v100box.llm.*``) resolve from this clone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
ROLES = ROOT / "ansible_collections" / "v100box" / "llm" / "roles"


class PlayError(RuntimeError):
    """ansible-playbook is missing here or the play failed; the message carries the end of its output."""


def ansible_playbook() -> str | None:
    """The ansible-playbook beside this Python (the project's venv), else on PATH."""
    beside = Path(sys.executable).parent / "ansible-playbook"
    return str(beside) if beside.is_file() else shutil.which("ansible-playbook")


def template(src: Path | str, dest: Path | str, *, name: str = "Render the template", **task: Any) -> dict:
    """An ``ansible.builtin.template`` task (mode 0644); ``task`` adds keywords such as ``loop``."""
    return {"name": name, "ansible.builtin.template": {"src": str(src), "dest": str(dest), "mode": "0644"}, **task}


def run_play(role: str, tasks: Sequence[Mapping[str, Any]], variables: Mapping[str, Any], folder: Path, *,
             timeout: float = 300) -> None:
    """Run ``tasks`` on localhost with ``role``'s defaults and vars and ``variables`` over them.

    The play, its variables and Ansible's own temporary files are written in ``folder``."""
    playbook_bin = ansible_playbook()
    if playbook_bin is None:
        raise PlayError("ansible-playbook is not installed here")
    folder.mkdir(parents=True, exist_ok=True)
    role_files = [ROLES / role / kind / "main.yml" for kind in ("defaults", "vars")]
    play = {"name": f"Run {role}'s templates on this machine", "hosts": "localhost", "connection": "local",
            "gather_facts": False, "vars_files": [str(path) for path in role_files if path.is_file()],
            "tasks": [dict(task) for task in tasks]}
    (folder / "play.yml").write_text(yaml.safe_dump([play], sort_keys=False))
    (folder / "vars.json").write_text(json.dumps({**variables, "ansible_python_interpreter": sys.executable}))
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(ROOT), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(folder / "ansible-tmp"), "ANSIBLE_HOME": str(folder / "ansible-home")}
    done = subprocess.run([playbook_bin, "-i", "localhost,", str(folder / "play.yml"), "-e", f"@{folder / 'vars.json'}"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise PlayError(f"ansible-playbook failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-1000:]}")
