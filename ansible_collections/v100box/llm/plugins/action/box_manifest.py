"""box_manifest on the controller: the digest of the run's inputs, and for a record what the run managed.

The digest covers every file of this collection that a run reads (roles, plugins, playbooks; not its documentation,
tests or molecule scenarios), the ansible-core version, the facts
the roles branch on, and every variable of the host that is not Ansible's own bookkeeping: inventory and group
variables, extra variables (the controller's secrets among them), role defaults. Any change to one of them makes
the next run a full one. A record is written only after a run without tags, without check mode and without a
failed task on the host (the ``v100box.llm.manifest`` callback notes both what was managed and what failed).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from functools import cache

from ansible import context
from ansible.module_utils.ansible_release import __version__ as ANSIBLE_VERSION
from ansible.plugins.action import ActionBase
from ansible.vars.clean import namespace_facts

DIGEST_FACT = "v100box_inputs_digest"  # set by the check at the start of a run, read by the record at its end
_CALLBACK = "ansible_collections.v100box.llm.plugins.callback.manifest"
_COLLECTION = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Facts the roles branch on: a box whose distribution changed under the same inventory runs in full.
_FACTS = ("distribution", "distribution_major_version", "distribution_version", "os_family", "pkg_mgr",
          "architecture", "system")
# What a check gathers (the play's facts, for the roles) when the box's facts are not cached yet.
GATHERED = ("os_family", "pkg_mgr")
# Variables that are Ansible's own bookkeeping or this run's, not inputs of the roles.
_SKIP = {"hostvars", "groups", "group_names", "inventory_hostname", "inventory_hostname_short", "inventory_dir",
         "inventory_file", "playbook_dir", "play_hosts", "role_names", "omit", "environment", "vars",
         "ansible_facts", "ansible_play_batch", "ansible_play_hosts", "ansible_play_hosts_all",
         "ansible_play_role_names", "ansible_role_names", "ansible_dependent_role_names", "ansible_play_name",
         "ansible_config_file", "ansible_playbook_python", "ansible_version", "ansible_check_mode",
         "ansible_diff_mode", "ansible_forks", "ansible_inventory_sources", "ansible_run_tags",
         "ansible_skip_tags", "ansible_verbosity", "ansible_search_path", "ansible_collection_name",
         "ansible_loop_var", "ansible_index_var", "ansible_parent_role_names", "ansible_parent_role_paths",
         "ansible_role_name", "role_name", "role_path", "role_uuid", "ansible_local", "discovered_interpreter_python",
         "module_setup", "gather_subset", "ansible_limit", "ansible_current_hosts", "ansible_failed_hosts",
         "ansible_delegated_vars", "ansible_loop", "v100box_full_run", DIGEST_FACT, "v100box_converged_max_age_s",
         # How this run reaches the box, which the strategy sets (mitogen's names its own connection and pipelining;
         # controller/stages/strategy.py): a box provisioned under one strategy is converged under the other.
         "ansible_connection", "ansible_pipelining"}

_SKIP_PREFIXES = ("__", "ansible_facts", "ansible_net_", "ansible_play_", "ansible_role_", "ansible_parent_role_")


@cache
def collection_digest() -> str:
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(_COLLECTION):
        # Not the tests or the roles' molecule scenarios, nor caches and tools' folders a clone gathers (.ansible,
        # .pytest_cache, .ruff_cache, ...): nothing of them reaches a box.
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "tests", "molecule") and not d.startswith("."))
        for name in sorted(files):
            # Nor the documentation (README.md, CHANGELOG.md): an edit to it alone leaves every box converged.
            if name.endswith((".pyc", ".pyo", ".md")):
                continue
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, _COLLECTION).encode() + b"\0")
            with open(path, "rb") as handle:
                digest.update(hashlib.sha256(handle.read()).digest())
    return digest.hexdigest()


def _plain(value):
    """A JSON-able copy of a raw (untemplated) variable value."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return str(value)


def input_hashes(task_vars: dict) -> dict[str, str]:
    """Each input by name (the collection, Ansible, the facts, each variable) with the SHA-256 of its value."""
    facts = task_vars.get("ansible_facts") or {}
    inputs = {
        "(collection)": collection_digest(),
        "(ansible-core)": ANSIBLE_VERSION,
        **{f"(fact {name})": _plain(facts.get(name)) for name in _FACTS},
        **{name: _plain(value) for name, value in task_vars.items()
           if name not in _SKIP and name not in facts and not name.startswith(_SKIP_PREFIXES)
           and not (name.startswith("ansible_") and name[len("ansible_"):] in facts)},  # facts are read, not inputs
    }
    return {name: hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]
            for name, value in inputs.items()}


def inputs_digest(task_vars: dict) -> str:
    return digest_of(input_hashes(task_vars))


def digest_of(hashes: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


class ActionModule(ActionBase):
    _supports_check_mode = True

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        host = task_vars.get("inventory_hostname", "")
        if args.get("state") == "check":
            facts = dict(task_vars.get("ansible_facts") or {})
            gathered = {}
            if not all(name in facts for name in GATHERED):
                # The facts the roles read, when no earlier run left them cached (the controller's runs keep them a
                # day): gathered here, not by a task of their own before this one, which would cost every box of
                # every run a task event (a skipped one on a converged box, about 40 ms of the control node's CPU).
                answer = self._execute_module(module_name="ansible.builtin.setup", module_args={"gather_subset": [
                    "!all", "!min", "distribution", "pkg_mgr"]}, task_vars=task_vars)
                if answer.get("failed") or answer.get("unreachable"):
                    result.update(answer)
                    return result
                gathered = answer.get("ansible_facts") or {}
                facts.update(namespace_facts(gathered)["ansible_facts"])  # as the play will see them: no ansible_ prefix
            # The inputs as the run starts: facts the run sets later are not inputs, so the record reuses this.
            hashes = input_hashes({**task_vars, "ansible_facts": facts})
            args["digest"], args["inputs"] = digest_of(hashes), hashes
            result["ansible_facts"] = {**gathered, DIGEST_FACT: {"digest": args["digest"], "inputs": hashes}}
        else:
            started = task_vars.get(DIGEST_FACT) or {}
            args["digest"] = str(started.get("digest") or "") if isinstance(started, dict) else ""
            args["inputs"] = dict(started.get("inputs") or {}) if isinstance(started, dict) else {}
            noted = sys.modules.get(_CALLBACK)
            partial = bool(context.CLIARGS.get("tags") not in (None, (), ["all"], ("all",))
                           or context.CLIARGS.get("skip_tags") or context.CLIARGS.get("start_at_task"))
            checking = bool(self._task.check_mode or self._play_context.check_mode)
            if noted is None or not args["digest"] or host in noted.FAILED or partial or checking:
                args["managed"] = {}  # removes an older record: the next run is a full one
            else:
                args["managed"] = noted.MANAGED.get(host, {})
        facts = result.pop("ansible_facts", None)
        result.update(self._execute_module(module_name="v100box.llm.box_manifest", module_args=args,
                                           task_vars=task_vars))
        if facts:
            result["ansible_facts"] = facts
        return result
