"""account_files writes into an account's home without ever following what the account put there: links, files
of another kind or owner are refused by name before anything is written, files are replaced by rename, and a
root process drops to the account before it touches the home (the module's functions, on real files)."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.unit.plugins.loader import load_module

files = load_module("account_files")
KEY_DIR = ".config/v100-llm-box/keys"


def params(**given):
    return {"directories": [], "files": [], "secret_files": {}, "check": [], "read": []} | given


def run(home: Path, check_mode: bool = False, **given):
    return files.work(params(**given), str(home), os.getuid(), check_mode)


def test_folders_keys_and_scripts_are_written_and_a_second_run_changes_nothing(tmp_path):
    wanted = dict(directories=[".local/bin", KEY_DIR], secret_files={f"{KEY_DIR}/box.key": "sk-1\n"},
                  files=[{"path": ".local/bin/claude-m", "content": "#!/bin/sh\n", "mode": "0700"}])
    first = run(tmp_path, **wanted)
    assert first["changed_paths"] == [".local", ".local/bin", ".config", ".config/v100-llm-box", KEY_DIR,
                                      ".local/bin/claude-m", f"{KEY_DIR}/box.key"]
    assert (tmp_path / KEY_DIR / "box.key").read_text() == "sk-1\n"
    assert stat.S_IMODE((tmp_path / KEY_DIR / "box.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / ".local/bin/claude-m").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / KEY_DIR).stat().st_mode) == 0o700
    assert run(tmp_path, **wanted)["changed_paths"] == []
    assert run(tmp_path, read=[".openclaw/openclaw.json"])["contents"] == {".openclaw/openclaw.json": None}


@pytest.mark.parametrize("link", [".local/bin", KEY_DIR, ".config"])
def test_a_linked_folder_on_the_way_is_refused_by_name_and_nothing_is_written(tmp_path, link):
    outside = tmp_path / "root-owned"
    outside.mkdir()
    home = tmp_path / "home"
    (home / Path(link).parent).mkdir(parents=True, exist_ok=True)
    (home / link).symlink_to(outside)
    with pytest.raises(files.Refused, match=f"^{home}/{link} is a symbolic link"):
        run(home, directories=[".local/bin", KEY_DIR], secret_files={f"{KEY_DIR}/box.key": "sk-1\n"},
            files=[{"path": ".local/bin/claude-m", "content": "x", "mode": "0700"}])
    assert list(outside.iterdir()) == []


def test_a_linked_file_is_neither_read_nor_written_through(tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text("root only\n")
    home = tmp_path / "home"
    (home / ".openclaw").mkdir(parents=True)
    (home / ".openclaw/openclaw.json").symlink_to(secret)
    with pytest.raises(files.Refused, match="openclaw.json is a symbolic link"):
        run(home, read=[".openclaw/openclaw.json"])
    with pytest.raises(files.Refused, match="openclaw.json is a symbolic link"):
        run(home, secret_files={".openclaw/openclaw.json": "{}"})
    assert secret.read_text() == "root only\n"


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another owner takes root")
def test_a_file_or_folder_of_another_owner_is_refused(tmp_path):
    (tmp_path / ".config").mkdir()
    os.chown(tmp_path / ".config", 65534, 65534)
    with pytest.raises(files.Refused, match=r"/\.config belongs to uid 65534, not to the account"):
        run(tmp_path, directories=[KEY_DIR])


@pytest.mark.skipif(os.getuid() != 0, reason="dropping to another account takes root")
def test_root_writes_as_the_account_so_the_kernel_refuses_what_the_account_may_not_do(tmp_path, monkeypatch):
    """nobody's home here is a folder nobody owns inside one it may not enter: root could write it, nobody not."""
    nobody = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp(prefix="account-files-"))  # pytest's own folders are root's only
    base.chmod(0o711)
    request_cleanup = [base]
    locked = base / "locked"
    locked.mkdir(mode=0o700)
    home = locked / "home"
    home.mkdir()
    os.chown(home, nobody.pw_uid, nobody.pw_gid)
    entry = SimpleNamespace(pw_uid=nobody.pw_uid, pw_gid=nobody.pw_gid, pw_dir=str(home))
    monkeypatch.setattr(files.pwd, "getpwnam", lambda name: entry)
    with pytest.raises(files.Refused, match="Permission denied"):
        files.as_account("nobody", False, params(directories=[".local/bin"]))
    assert list(home.iterdir()) == []
    os.chmod(locked, 0o755)  # now nobody may reach its home: the same call writes, as nobody
    answer = files.as_account("nobody", False, params(secret_files={"key": "sk\n"}))
    assert answer["changed_paths"] == ["key"] and (home / "key").stat().st_uid == nobody.pw_uid
    for folder in request_cleanup:
        shutil.rmtree(folder)
