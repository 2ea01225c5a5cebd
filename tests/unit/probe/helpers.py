"""Where the probe fixtures live, and small readers shared by the probe tests."""

from __future__ import annotations

from pathlib import Path

from controller.model.profile import HardwareProfile
from controller.stages.probe import parse_outputs, read_dir

WRITTEN = Path(__file__).resolve().parents[2] / "fixtures" / "probe"


def machine(name: str) -> dict[str, str]:
    """The outputs of one written fixture machine (tests/fixtures/probe/<name>/)."""
    return read_dir(WRITTEN / name)


def real_text(folder: Path, name: str) -> str:
    return (folder / name).read_bytes().decode("utf-8", errors="replace")


def profile_of(outputs: dict[str, str], model_dir: str | None = None) -> HardwareProfile:
    return parse_outputs(outputs, model_dir=model_dir)


def warnings_about(profile: HardwareProfile, file: str) -> list[str]:
    return [warning for warning in profile.warnings if warning.startswith(file)]
