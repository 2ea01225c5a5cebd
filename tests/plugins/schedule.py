"""How the suite shares this machine's cores (pytest-xdist: ``-n auto`` in pyproject.toml).

Each test file is one unit of work, kept on one worker in its order, so that its module-scoped fixtures (a booted and
provisioned target, a served site) are set up once and its tests may build on each other; the files in
``PER_TEST_FILES`` (the molecule scenarios: each its own container, nothing shared) hand out each test on its own.
The units go out longest first, so that the short ones fill in beside the long ones and no worker starts a long file
when the others are nearly done: the molecule scenarios and the integration files by their measured time, then the
unit tests. The scenarios go out one between every two integration files rather than all at once: a scenario keeps
its worker waiting on its container (systemd's boot, apt, the servers it starts) for about half its time, so three
side by side left a third of the two cores idle for the first five minutes of a full run, while the integration files
keep a core busy (vmstat over a full run, 2026-11-27). ``-n 0`` (or ``-p no:xdist``) runs everything in this process,
in the same order.

(xdist's own ``--dist loadgroup`` does not group under pytest 9: it renames the items in a way pytest 9 no longer
reads. This scheduler groups by the test id instead.)
"""

from __future__ import annotations

import os

import pytest
from xdist.scheduler import LoadScopeScheduling

PER_TEST_FILES = frozenset({"tests/integration/test_molecule.py"})
# Seconds each of the longest files took in a full run under three workers (2026-11-26, provisions that run every
# role under mitogen: junit times summed per file, setup and teardown included): only their order matters. A file
# not named counts as short.
MEASURED_SECONDS = {
    "tests/integration/test_llama_firewall.py": 312,
    "tests/integration/test_fleet_status.py": 280,
    "tests/integration/test_provision_e2e.py": 261,
    "tests/integration/test_lan_cache.py": 223,
    "tests/integration/test_seal.py": 215,
    "tests/integration/test_llm_gateway.py": 194,
    "tests/integration/test_thermal_guard.py": 190,
    "tests/integration/test_fleet_provision.py": 170,
    "tests/integration/test_engine_rollback.py": 168,
    "tests/integration/test_lint.py": 160,
    "tests/integration/test_certify.py": 153,
    "tests/integration/test_demo_agents.py": 152,
    "tests/integration/test_wheel.py": 106,
    "tests/integration/test_on_demand.py": 102,
    "tests/integration/test_nvidia_nodes.py": 98,
    "tests/integration/test_fleet_lock.py": 92,
    "tests/integration/test_target.py": 86,
    "tests/integration/test_collection.py": 71,
    "tests/integration/test_probe_live.py": 61,
    "tests/integration/test_driver_e2e.py": 59,
    "tests/integration/test_role_preflights.py": 51,
    "tests/integration/test_agent_clients.py": 45,
}
# Workers per core: the integration tests spend much of their time waiting on containers and servers.
WORKERS_PER_CORE = 1.5


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one and a half workers a core (3 on the 2-core CI machine); V100BOX_TEST_WORKERS overrides."""
    wanted = os.environ.get("V100BOX_TEST_WORKERS")
    if wanted:
        return int(wanted)
    return max(1, round((os.cpu_count() or 1) * WORKERS_PER_CORE))


def scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or the test itself in the files of PER_TEST_FILES."""
    path = nodeid.split("::", 1)[0]
    return nodeid if path in PER_TEST_FILES else path


class FileScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with scope_of as the scope."""

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> FileScheduling:
    return FileScheduling(config, log)


# How many integration files go out between two molecule scenarios: one worker of three on a scenario.
FILES_PER_SCENARIO = 2


def ordered_units(units: list[tuple[str, list[pytest.Item]]]) -> list[tuple[str, list[pytest.Item]]]:
    """The units (scope, its tests) in the order they go out: a scenario, FILES_PER_SCENARIO integration files
    longest first, the next scenario..., then what is left of either, then the unit tests."""
    scenarios = [unit for unit in units if unit[0].split("::", 1)[0] in PER_TEST_FILES]
    others = [unit for unit in units if unit[0].split("::", 1)[0] not in PER_TEST_FILES]
    integration = sorted((unit for unit in others if unit[0].startswith("tests/integration/")),
                         key=lambda unit: -MEASURED_SECONDS.get(unit[0], 0))  # stable: the rest keep their order
    rest = [unit for unit in others if not unit[0].startswith("tests/integration/")]
    order: list[tuple[str, list[pytest.Item]]] = []
    while scenarios or integration:
        order.extend(scenarios[:1])
        order.extend(integration[:FILES_PER_SCENARIO])
        scenarios, integration = scenarios[1:], integration[FILES_PER_SCENARIO:]
    return order + rest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A file's tests stay together and in their order. The workers' collections are what xdist hands out from, so
    # the units go out in this order.
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(scope_of(item.nodeid), []).append(item)
    items[:] = [item for _scope, tests in ordered_units(list(units.items())) for item in tests]
