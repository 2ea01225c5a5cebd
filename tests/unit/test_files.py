import os

import pytest

from controller.files import write_atomic


def test_write_atomic_replaces_whole_files_with_the_usual_mode(tmp_path):
    target = tmp_path / "sub" / "report.json"
    write_atomic(target, "first")
    write_atomic(target, b"second")
    assert target.read_text() == "second"
    assert (target.stat().st_mode & 0o777) == 0o666 & ~_umask()
    assert sorted(os.listdir(target.parent)) == ["report.json"]


def test_write_atomic_leaves_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "hosts.yml"
    write_atomic(target, "good")
    with pytest.raises(TypeError):
        write_atomic(target, object())  # type: ignore[arg-type]
    assert target.read_text() == "good" and os.listdir(tmp_path) == ["hosts.yml"]


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current
