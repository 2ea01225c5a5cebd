"""Every role default is documented in meta/argument_specs.yml with the same default, and vice versa."""

from pathlib import Path

import pytest
import yaml

ROLES = sorted(path.parent.parent for path in Path(__file__).resolve().parents[2].glob("roles/*/defaults/main.yml"))


@pytest.mark.parametrize("role", ROLES, ids=[role.name for role in ROLES])
def test_defaults_and_argument_specs_agree(role: Path):
    defaults = yaml.safe_load((role / "defaults/main.yml").read_text()) or {}
    options = yaml.safe_load((role / "meta/argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert set(defaults) == set(options), "defaults and argument specs name different variables"
    for name, value in defaults.items():
        spec = options[name]
        assert spec.get("description"), f"{name} has no description"
        assert spec.get("default") == value, f"{name}: default {value!r} but the spec says {spec.get('default')!r}"
        assert name.startswith(role.name + "_"), f"{name} lacks the role prefix"


def test_every_role_has_a_molecule_scenario_and_readme():
    for role in ROLES:
        assert (role / "README.md").is_file(), role.name
        assert (role / "meta" / "argument_specs.yml").is_file(), role.name
        # No Windows target exists here: win_* roles are tested by rendering their artefacts (tests/unit/windows).
        if not role.name.startswith("win_"):
            assert (role / "molecule" / "default" / "molecule.yml").is_file(), role.name
