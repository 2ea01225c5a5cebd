"""The playbooks run one play for Linux and Windows boxes alike, pass Ansible's syntax check with a Windows
inventory, gather facts each OS knows, and the roles call Windows modules with options those modules have."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.unit.windows.ansible_local import MERGED_ROLES, PROJECT, ROLE_NAMES, role_vars

PLAYBOOKS = PROJECT / "ansible_collections/v100box/llm/playbooks"


def tool(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def plays(name: str) -> list[dict]:
    return yaml.safe_load((PLAYBOOKS / name).read_text())


# Roles with no Windows side (they refuse Windows boxes, or leave them to llama_service's claude-<model>.ps1): in
# site.yml, not among the merged roles.
LINUX_ONLY = ("agent_clients", "llm_gateway")
# The fleet's LAN cache (Linux only) runs on its host right after the driver, before the roles that fetch through it.
CACHE_ROLE = "lan_cache"
# Run by their own playbooks (certify.yml reads, seal.yml hands a certified box over), never by site.yml.
SEAL_ROLE = "box_seal"


def test_site_is_one_play_running_the_roles_in_order():
    (site,) = plays("site.yml")
    assert site["hosts"] == "all"
    order = [ROLE_NAMES[0], CACHE_ROLE, *ROLE_NAMES[1:-1], *LINUX_ONLY, ROLE_NAMES[-1]]
    assert [role["role"] for role in site["roles"]] == [f"v100box.llm.{name}" for name in order]
    assert site["roles"][0]["vars"] == {"nvidia_driver_require_loaded": True}
    (driver,) = plays("driver.yml")
    assert driver["hosts"] == "all" and [role["role"] for role in driver["roles"]] == ["v100box.llm.nvidia_driver"]
    (verify,) = plays("verify.yml")
    assert verify["hosts"] == "all" and [role["role"] for role in verify["roles"]] == ["v100box.llm.llama_verify"]
    (clients,) = plays("clients.yml")  # the fleet's workstations only: boxes are never in their inventory
    assert clients["hosts"] == "workstations" and [role["role"] for role in clients["roles"]] == ["v100box.llm.agent_clients"]
    assert not (PLAYBOOKS / "windows.yml").exists()
    (seal,) = plays("seal.yml")
    assert seal["hosts"] == "all" and SEAL_ROLE in str(seal)
    (certify,) = plays("certify.yml")
    assert certify["hosts"] == "all" and {task["ansible.builtin.import_role"]["name"] for task in certify["tasks"]} == {
        "v100box.llm.llama_verify"}
    assert sorted(path.name for path in (PROJECT / "ansible_collections/v100box/llm/roles").iterdir()) == sorted(
        [*ROLE_NAMES, *LINUX_ONLY, CACHE_ROLE, SEAL_ROLE])


@pytest.mark.parametrize("playbook", ["site.yml", "driver.yml", "verify.yml"])
def test_playbook_syntax_with_windows_and_linux_hosts(tmp_path, playbook):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("windows:\n  hosts:\n    box9:\n      ansible_connection: winrm\n"
                         "linux:\n  hosts:\n    box3:\n      ansible_host: 192.0.2.10\n")
    result = subprocess.run(
        [tool("ansible-playbook"), "--syntax-check", "-i", str(inventory), f"ansible_collections/v100box/llm/playbooks/{playbook}"],
        cwd=PROJECT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("playbook", ["site.yml", "driver.yml"])
def test_fact_gathering_asks_each_os_for_a_subset_it_knows(tmp_path, playbook):
    """The setup task of the play, its module swapped for debug (which contacts no host), evaluated per host; in
    site.yml also the condition of the converged fast path's module (Linux only), which runs before any facts are
    gathered (its action gathers them for a Linux box)."""
    (play,) = plays(playbook)
    (gather,) = [task for task in play["pre_tasks"] if "ansible.builtin.setup" in task]
    subset = gather["ansible.builtin.setup"]["gather_subset"]
    tasks = [{"name": "Show it", "ansible.builtin.debug": {"msg": subset}, "vars": gather.get("vars", {})}]
    if playbook == "site.yml":
        (fast,) = [task for task in play["pre_tasks"] if "v100box.llm.box_manifest" in task]
        assert play["pre_tasks"][0] is fast and play["pre_tasks"].index(gather) > 1  # a converged box never sees it
        tasks.append({"name": "Run the fast path's module?", "ansible.builtin.debug": {"msg": "yes"},
                      "when": fast["when"]})
    probe = {"name": "Show the subset", "hosts": "all", "gather_facts": False, "tasks": tasks,
             # site.yml's roles' variables are its play's: its Windows test is llama_verify's
             "vars_files": role_vars("llama_verify") if playbook == "site.yml" else []}
    (tmp_path / "play.yml").write_text(yaml.safe_dump([probe]))
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {
        "windows": {"hosts": {"win_by_group": {"ansible_connection": "local"}}},
        "linux": {"hosts": {"lin": {"ansible_connection": "local"},
                            "win_by_connection": {"ansible_connection": "psrp"},
                            "win_by_shell": {"ansible_connection": "local", "ansible_shell_type": "cmd"}}}}}}))
    result = subprocess.run(
        [tool("ansible-playbook"), "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml")],
        cwd=PROJECT, capture_output=True, text=True, timeout=120, check=False,
        env={"ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json", "PATH": str(Path(sys.executable).parent)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    answers = json.loads(result.stdout)["plays"][0]["tasks"]
    hosts = answers[0]["hosts"]
    windows = ["!all", "!min", "distribution"]
    assert hosts["win_by_group"]["msg"] == windows and hosts["win_by_connection"]["msg"] == windows
    if playbook == "site.yml":  # driver.yml tells Windows by group and connection only
        assert hosts["win_by_shell"]["msg"] == windows
    assert hosts["lin"]["msg"] == [*windows, "pkg_mgr"]
    if playbook == "site.yml":
        fast = answers[1]["hosts"]
        assert fast["lin"].get("msg") == "yes"
        assert fast["win_by_group"].get("skipped") and fast["win_by_connection"].get("skipped")
        assert fast["win_by_shell"].get("skipped")


def test_verify_gathers_no_facts_and_its_role_tells_windows_from_the_connection():
    (verify,) = plays("verify.yml")
    assert verify["gather_facts"] is False
    text = (PROJECT / "ansible_collections/v100box/llm/roles" / "llama_verify" / "vars" / "main.yml").read_text()
    assert "ansible_connection" in text and "'windows' in group_names" in text


def _module_tasks(items):
    for task in items or []:
        for section in ("block", "rescue", "always"):
            yield from _module_tasks(task.get(section))
        for key, value in task.items():
            if key.startswith(("ansible.windows.", "community.windows.")) and isinstance(value, dict):
                yield key, set(value)


def test_windows_modules_are_called_with_options_they_have():
    used: dict[str, set[str]] = {}
    for role in MERGED_ROLES:
        for path in [*role.glob("tasks/*.yml"), *role.glob("handlers/*.yml")]:
            for module, options in _module_tasks(yaml.safe_load(path.read_text())):
                used.setdefault(module, set()).update(options)
    assert "ansible.windows.win_powershell" in used and "community.windows.win_firewall_rule" in used
    docs = subprocess.run([tool("ansible-doc"), "-j", *sorted(used)], capture_output=True, text=True, check=True)
    documented = {name: set(entry["doc"].get("options", {})) for name, entry in json.loads(docs.stdout).items()}
    assert {
        module: options - documented[module] for module, options in used.items() if options - documented[module]
    } == {}


def test_windows_tasks_use_only_windows_modules():
    """A Linux module in a Windows task file would fail only on a real Windows host."""
    linux_only = ("ansible.builtin.command", "ansible.builtin.file", "ansible.builtin.copy", "ansible.builtin.template",
                  "ansible.builtin.stat", "ansible.builtin.uri", "ansible.builtin.systemd_service")
    for role in MERGED_ROLES:
        for path in role.glob("tasks/windows*.yml"):
            text = path.read_text()
            assert not [module for module in linux_only if module + ":" in text], path
