"""One role per concern for both OSes, each documenting its variables once, and none restating a fact that the
controller owns (controller/model/rules.py): those reach the roles through the inventory."""

import re
from pathlib import Path

import pytest
import yaml

from controller.model import rules

ROOT = Path(__file__).resolve().parents[2]
ROLE_NAMES = ["agent_clients", "box_seal", "gguf_model", "lan_cache", "llama_engine", "llama_service", "llama_verify",
              "llm_gateway", "nvidia_driver", "thermal_guard"]
ROLES = [ROOT / "ansible_collections/v100box/llm/roles" / name for name in ROLE_NAMES]
# Roles with no Windows side: the planner refuses them on a Windows box and main.yml (or the preflight it runs
# first) says so. llm_gateway's HAProxy has no Windows build; agent_clients writes per-account launch scripts on
# Linux (a Windows box's come from llama_service); lan_cache (nginx) runs on the fleet's Linux cache host; box_seal
# hands a certified Linux box to its buyer. Each has a molecule scenario besides its end-to-end test
# (test_llm_gateway.py, test_provision_e2e.py, test_lan_cache.py, test_seal.py).
LINUX_ONLY = {"agent_clients", "box_seal", "llm_gateway", "lan_cache"}
# Variables whose values are facts of controller/model/rules.py: the inventory carries them, no role defaults them.
FACT_VARIABLES = {
    "nvidia_driver": {"nvidia_driver_window", "nvidia_driver_installer"},
    "gguf_model": {"gguf_model_dir"},
    "llama_service": {"llama_service_template_dir"},
}


def _options(role: Path) -> dict:
    return yaml.safe_load((role / "meta/argument_specs.yml").read_text())["argument_specs"]["main"]["options"]


def test_one_role_per_concern():
    assert sorted(path.name for path in (ROOT / "ansible_collections/v100box/llm/roles").iterdir() if path.is_dir()) == ROLE_NAMES


@pytest.mark.parametrize("role", ROLES, ids=ROLE_NAMES)
def test_defaults_and_argument_specs_agree(role: Path):
    defaults = yaml.safe_load((role / "defaults/main.yml").read_text()) or {}
    options = _options(role)
    assert set(defaults) <= set(options), f"{set(defaults) - set(options)} have no argument spec"
    for name, spec in options.items():
        assert spec.get("description"), f"{name} has no description"
        assert name.startswith(role.name + "_"), f"{name} lacks the role prefix"
        if name in defaults:
            assert spec.get("default") == defaults[name], f"{name}: default {defaults[name]!r} but the spec says " \
                                                          f"{spec.get('default')!r}"
        else:
            # Given by the inventory only: the spec names no default either.
            assert "default" not in spec, f"{name} has a default in its spec but none in defaults/main.yml"


@pytest.mark.parametrize("role", ROLES, ids=ROLE_NAMES)
def test_fact_variables_come_from_the_inventory_only(role: Path):
    defaults = yaml.safe_load((role / "defaults/main.yml").read_text()) or {}
    options = _options(role)
    for name in FACT_VARIABLES.get(role.name, set()):
        assert name in options, f"{name} is not in {role.name}'s argument spec"
        assert name not in defaults and "default" not in options[name], f"{role.name} defaults {name}"
    for name in ("nvidia_driver_window", "gguf_model_dir", "llama_service_template_dir"):
        if name in options:
            assert options[name].get("required") is True, f"{name} must be required"


FACT_TEXTS = sorted({
    str(rules.DRIVER_FIRST_MAJOR), str(rules.DRIVER_LAST_MAJOR), *map(str, rules.DRIVER_BRANCHES),
    rules.WINDOWS_DRIVER, *rules.DEFAULT_MODEL_DIR.values(),
})


def _defaults_and_vars_files() -> list[Path]:
    return sorted(path for role in ROLES for folder in ("defaults", "vars") for path in (role / folder).glob("*"))


def _restated(text: str) -> list[str]:
    found = []
    for fact in FACT_TEXTS:
        if fact.isdigit():
            if re.search(rf"(?<![0-9]){fact}(?![0-9])", text):
                found.append(fact)
        elif fact.lower() in text.lower().replace("\\\\", "\\"):
            found.append(fact)
    return found


@pytest.mark.parametrize("path", _defaults_and_vars_files(), ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}/{p.name}")
def test_no_role_restates_a_fact_of_the_controller(path: Path):
    assert _restated(path.read_text()) == [], f"{path} restates a fact of controller/model/rules.py"


def test_the_fact_check_catches_a_restated_fact():
    assert _restated("_nvidia_driver_branch_max: 580\n") == ["580"]
    assert _restated("x: 573.96") == ["573.96"]
    assert _restated("gguf_model_dir: /var/lib/llama/models") == ["/var/lib/llama/models"]
    assert _restated("gguf_model_dir: 'C:\\LLAMA\\models'") == ["C:\\llama\\models"]
    assert _restated("nvidia_driver_reboot_timeout: 1800\nport: 15800") == []


def _task_files() -> list[Path]:
    return sorted(path for role in ROLES for path in [*role.glob("tasks/*.yml"), *role.glob("templates/*")])


def test_roles_pick_v100s_by_the_controllers_decision_and_name_the_window_by_its_label():
    for path in _task_files():
        text = path.read_text()
        assert not re.search(r"search'?, '?V100", text), f"{path} finds V100s by name; use selectattr('is_v100')"
        assert not re.search(r"R(570|580|589)(?![0-9])", text), f"{path} spells a driver branch; use nvidia_driver_window.label"


def test_urls_built_from_the_bind_use_the_reachable_host_filter():
    for path in _task_files():
        text = path.read_text()
        assert "in ['0.0.0.0', '::']" not in text, f"{path} re-derives the reachable host; use | reachable_host"


@pytest.mark.parametrize("role", ROLES, ids=ROLE_NAMES)
def test_each_role_dispatches_by_os_and_has_docs_and_a_scenario(role: Path):
    assert (role / "README.md").is_file() and (role / "meta" / "argument_specs.yml").is_file()
    main = (role / "tasks" / "main.yml").read_text()
    # With the task files main.yml imports (static: they are part of it).
    dispatch = main + "".join((role / "tasks" / name).read_text()
                              for name in re.findall(r"import_tasks: (\S+\.yml)", main))
    assert "os_family" in dispatch or "windows" in dispatch, f"{role.name}'s main.yml does not pick the OS's tasks"
    assert (role / "molecule" / "default" / "molecule.yml").is_file(), f"{role.name} has no molecule scenario"
    if role.name in LINUX_ONLY:
        platforms = {p["name"] for p in yaml.safe_load((role / "meta/main.yml").read_text())["galaxy_info"]["platforms"]}
        assert "Windows" not in platforms and "Windows" in main, f"{role.name} must refuse Windows in main.yml"
        return
    assert (role / "tasks" / "windows.yml").is_file() or list(role.glob("tasks/windows-*.yml"))
    platforms = {p["name"] for p in yaml.safe_load((role / "meta/main.yml").read_text())["galaxy_info"]["platforms"]}
    assert "Windows" in platforms and "Debian" in platforms


def _tasks(entries) -> list[dict]:
    """Every task of a task list, those in blocks (and their rescue and always) included."""
    found = []
    for entry in entries or []:
        if isinstance(entry, dict):
            found.append(entry)
            for part in ("block", "rescue", "always"):
                found += _tasks(entry.get(part))
    return found


def test_an_included_file_in_a_loop_is_looped_over_by_position():
    # The linear strategy runs an included file once for every group of boxes that included it with the same loop
    # item: a loop over per-box data (packs, models, servers) makes a copy per box and runs them one box after
    # another. Looping over positions (range) keeps the boxes of a fleet run together.
    collection = ROOT / "ansible_collections/v100box/llm"
    looped = []
    for path in sorted([*collection.glob("roles/*/tasks/*.yml"), *collection.glob("roles/*/handlers/*.yml"),
                        *collection.glob("playbooks/*.yml")]):
        document = yaml.safe_load(path.read_text()) or []
        plays = [entry for entry in document if isinstance(entry, dict) and "hosts" in entry]
        entries = [task for play in plays for part in ("pre_tasks", "tasks", "post_tasks", "handlers")
                   for task in play.get(part) or []] if plays else document
        for task in _tasks(entries):
            include = [key for key in task if key.endswith(("include_tasks", "include_role"))]
            loop = task.get("loop", task.get("with_items"))
            if include and loop is not None:
                looped.append(path.relative_to(collection))
                assert str(loop).replace(" ", "").startswith("{{range("), f"{path}: {task.get('name')} loops over {loop}"
    assert looped  # the packs and the Windows models are still installed in a loop
