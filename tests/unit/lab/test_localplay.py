"""lab.localplay: a role's templates rendered on this machine see the role's defaults and vars with the caller's
variables over them, and a play that fails says why."""

from __future__ import annotations

import pytest
import yaml

from lab import localplay


def test_a_template_sees_the_roles_defaults_and_vars_under_the_callers_variables(tmp_path):
    defaults = yaml.safe_load((localplay.ROLES / "llm_gateway" / "defaults" / "main.yml").read_text())
    template = tmp_path / "show.j2"
    template.write_text("{{ llm_gateway_port }} {{ llm_gateway_bind }} {{ _llm_gateway_name }}\n")
    localplay.run_play("llm_gateway", [localplay.template(template, tmp_path / "shown")],
                       {"llm_gateway_port": 8123}, tmp_path / "play")
    assert (tmp_path / "shown").read_text().split() == ["8123", defaults["llm_gateway_bind"], "llm-gateway"]


def test_a_failing_play_raises_with_ansibles_reason(tmp_path):
    template = tmp_path / "broken.j2"
    template.write_text("{{ no_such_variable_anywhere }}\n")
    with pytest.raises(localplay.PlayError, match="no_such_variable_anywhere"):
        localplay.run_play("llm_gateway", [localplay.template(template, tmp_path / "never")], {}, tmp_path / "play")
    assert not (tmp_path / "never").exists()
