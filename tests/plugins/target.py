"""Fixtures for the systemd target container (lab.target).

Any test that uses one of these fixtures is marked ``podman`` at collection, so
``-m "not podman"`` deselects it. Without podman (or root) the fixtures skip on a workstation
but fail under CI=true: a CI run must never pass by skipping the real target.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from lab import host as lab_host
from lab import image as lab_image
from lab import target as lab_target

TARGET_FIXTURES = frozenset({"target_image", "systemd_target", "target_factory"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if TARGET_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.podman)


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"the systemd target is required in CI: {reason}", pytrace=False)
    pytest.skip(f"systemd target unavailable: {reason}")


@pytest.fixture(scope="session")
def target_image() -> str:
    """The target image tag, built (debootstrap, minutes) or imported once per machine."""
    try:
        lab_host.ensure_host_ready()
        lab_target.cleanup_stale()  # leftovers of killed sessions hold ports and memory
        return lab_image.ensure_image()
    except lab_host.LabUnavailable as exc:
        _unavailable(str(exc))
        raise  # unreachable: skip/fail raise


@pytest.fixture(scope="module")
def systemd_target(target_image: str) -> Iterator[lab_target.Target]:
    """One started target per test module (boot to ssh-ready takes a couple of seconds)."""
    with lab_target.Target.start(image=target_image) as started:
        yield started


@pytest.fixture
def target_factory(target_image: str) -> Iterator[Callable[..., lab_target.Target]]:
    """Start extra targets inside one test; every one still running is removed at teardown."""
    started: list[lab_target.Target] = []

    def start(**kwargs: object) -> lab_target.Target:
        one = lab_target.Target.start(image=target_image, **kwargs)  # type: ignore[arg-type]
        started.append(one)
        return one

    yield start
    for one in started:
        one.stop()
