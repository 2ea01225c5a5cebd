"""The mitogen strategy the molecule scenarios run the roles under (``mitogen``, a test dependency): one Python on the
instance for a whole play instead of a connection round trip or more a task. The product's own runs keep Ansible's
plain strategy (ARCHITECTURE.md: The converged fast path)."""

from __future__ import annotations

from pathlib import Path

STRATEGY = "mitogen_linear"


def ansible_environment() -> dict[str, str]:
    """The variables that make ansible-playbook run its plays under mitogen."""
    import ansible_mitogen

    return {"ANSIBLE_STRATEGY_PLUGINS": str(Path(ansible_mitogen.__file__).parent / "plugins" / "strategy"),
            "ANSIBLE_STRATEGY": STRATEGY}
