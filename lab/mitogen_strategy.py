"""The mitogen strategy the molecule scenarios and the firewall test run the roles under: the one the controller's
provisions use when every role runs (controller/stages/strategy.py, which owns how it is set)."""

from __future__ import annotations

from controller.stages.strategy import MITOGEN as STRATEGY
from controller.stages.strategy import environment


def ansible_environment() -> dict[str, str]:
    """The variables that make ansible-playbook run its plays under mitogen."""
    return environment(STRATEGY)
