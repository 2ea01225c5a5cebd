"""gguf_download against the real local file server: what an operator sees on each kind of run.

The worker functions run in-process (so the server's byte counter and request log can be read
beside them); the module itself also runs as Ansible runs it, as a script with a JSON args file.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lab.fileserver import FileServer
from tests.unit.plugins.loader import load_module, module_command, module_env, run_module

TOKEN = "hf_TESTtoken0123456789abcdef"
SIZE = 8 << 20


gd = load_module("gguf_download")


@dataclass(frozen=True)
class Model:
    root: Path
    data: bytes
    sha256: str


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    root = tmp_path_factory.mktemp("hub")
    data = os.urandom(SIZE)
    (root / "org" / "repo").mkdir(parents=True)
    (root / "org" / "repo" / "model.gguf").write_bytes(data)
    return Model(root, data, hashlib.sha256(data).hexdigest())


@pytest.fixture
def server(model: Model) -> Iterator[FileServer]:
    with FileServer(model.root) as srv:
        yield srv


@pytest.fixture
def token_server(model: Model) -> Iterator[FileServer]:
    with FileServer(model.root, token=TOKEN) as srv:
        yield srv


def _params(srv: FileServer, model: Model, folder: Path, **overrides: Any) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    params = {
        "url": srv.hub_url("org", "repo", "model.gguf"),
        "dest": str(folder / "model.gguf"),
        "sha256": model.sha256,
        "size": None,
        "token": None,
        "headers": {},
        "timeout": 10,
    }
    return params | overrides


def _gets(srv: FileServer) -> list[Any]:
    return [seen for seen in srv.requests if seen.method == "GET"]


def _run_module(
    args: dict[str, Any], tmp_path: Path
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Run the module the way Ansible's debug path does: the script plus a JSON args file."""
    return run_module("gguf_download", tmp_path, args)


def test_fresh_download_lands_the_verified_file(server: FileServer, model: Model, tmp_path: Path) -> None:
    params = _params(server, model, tmp_path / "models")

    result = gd.ensure(params)

    dest = Path(params["dest"])
    assert result["changed"] is True
    assert (result["size"], result["bytes_transferred"], result["resumed_from"]) == (SIZE, SIZE, 0)
    assert dest.read_bytes() == model.data
    assert not Path(params["dest"] + ".part").exists()
    assert json.loads(Path(params["dest"] + ".verified").read_text())["sha256"] == model.sha256
    assert server.bytes_sent == SIZE


def test_verified_file_is_skipped_without_hashing(
    server: FileServer, model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = _params(server, model, tmp_path / "models")
    gd.ensure(params)
    server.reset_counters()

    def no_hashing(*_: object) -> None:
        raise AssertionError("a verified file was hashed again")

    monkeypatch.setattr(gd, "hash_file", no_hashing)
    monkeypatch.setattr(gd.hashlib, "sha256", no_hashing)
    result = gd.ensure(params)

    assert result["changed"] is False
    assert result["bytes_transferred"] == 0
    assert server.requests == []


def test_module_trusts_the_marker_instead_of_rereading(
    server: FileServer, model: Model, tmp_path: Path
) -> None:
    """Same size and mtime as the marker says -> not reread, shown by bytes it would have caught."""
    params = _params(server, model, tmp_path / "models")
    gd.ensure(params)
    dest = Path(params["dest"])
    stat = dest.stat()
    dest.write_bytes(bytes(SIZE))  # different content, same size ...
    os.utime(dest, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ... and the marker's mtime
    server.reset_counters()

    proc, result = _run_module(params, tmp_path)

    assert proc.returncode == 0, proc.stdout
    assert result["changed"] is False
    assert "marker" in result["msg"]
    assert server.requests == []


def test_unmarked_good_file_is_hashed_once_and_marked(
    server: FileServer, model: Model, tmp_path: Path
) -> None:
    params = _params(server, model, tmp_path / "models")
    Path(params["dest"]).write_bytes(model.data)

    result = gd.ensure(params)

    assert result["changed"] is False
    assert server.requests == []
    assert gd.is_verified(params["dest"], model.sha256)


def test_checksum_mismatch_leaves_nothing_at_the_final_path(
    server: FileServer, model: Model, tmp_path: Path
) -> None:
    wrong = hashlib.sha256(b"another file").hexdigest()
    params = _params(server, model, tmp_path / "models", sha256=wrong)

    with pytest.raises(gd.DownloadError) as failure:
        gd.ensure(params)

    assert wrong in str(failure.value) and model.sha256 in str(failure.value)
    assert sorted(os.listdir(tmp_path / "models")) == []


def test_checksum_mismatch_keeps_the_older_good_file(
    server: FileServer, model: Model, tmp_path: Path
) -> None:
    older = b"older good model" * 1000
    older_sha = hashlib.sha256(older).hexdigest()
    params = _params(server, model, tmp_path / "models", sha256=older_sha)
    Path(params["dest"]).write_bytes(older)
    gd.write_marker(params["dest"], older_sha)
    # The file vars now name a new sha256, but the server still serves something else.
    params["sha256"] = hashlib.sha256(b"the release that never arrived").hexdigest()

    with pytest.raises(gd.DownloadError, match="Checksum mismatch"):
        gd.ensure(params)

    assert Path(params["dest"]).read_bytes() == older
    assert gd.is_verified(params["dest"], older_sha)
    assert not Path(params["dest"] + ".part").exists()


def test_interrupted_download_resumes_where_it_stopped(
    server: FileServer, model: Model, tmp_path: Path
) -> None:
    params = _params(server, model, tmp_path / "models")
    half = SIZE // 2
    server.drop_after = half

    with pytest.raises(gd.DownloadError, match=f"rerun resumes from byte {half}"):
        gd.ensure(params)
    assert Path(params["dest"] + ".part").stat().st_size == half
    assert not Path(params["dest"]).exists()

    server.drop_after = None
    result = gd.ensure(params)

    assert (result["resumed_from"], result["bytes_transferred"]) == (half, SIZE - half)
    assert Path(params["dest"]).read_bytes() == model.data
    assert _gets(server)[-1].range == f"bytes={half}-"
    assert server.bytes_sent <= 1.02 * SIZE


@pytest.fixture
def small_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on a 32 MiB filesystem: a real tmpfs where mounting works, else statvfs narrowed."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=32m,mode=0755", "tmpfs", str(folder)], check=False, capture_output=True
        ).returncode
        == 0
    )
    if not mounted:
        monkeypatch.setattr(gd, "free_bytes", lambda _folder: 32 << 20)
    yield folder
    if mounted:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("size_known", [True, False], ids=["size-given", "size-from-HEAD"])
def test_too_little_space_is_refused_before_any_byte(
    server: FileServer, model: Model, small_folder: Path, size_known: bool
) -> None:
    params = _params(server, model, small_folder, size=SIZE if size_known else None)
    free = gd.free_bytes(str(small_folder))
    needed = SIZE + gd.SPACE_MARGIN

    with pytest.raises(gd.DownloadError) as failure:
        gd.ensure(params)

    message = str(failure.value)
    assert str(small_folder) in message
    assert f"{needed} bytes" in message and f"{free} bytes" in message
    assert f"{needed / 2**30:.2f} GiB" in message
    assert _gets(server) == [] and server.bytes_sent == 0
    assert os.listdir(small_folder) == []


def test_redirect_is_followed(server: FileServer, model: Model, tmp_path: Path) -> None:
    params = _params(
        server, model, tmp_path / "models", url=f"{server.url}/redirect/org/repo/resolve/main/model.gguf"
    )

    result = gd.ensure(params)

    assert result["changed"] is True
    assert Path(params["dest"]).read_bytes() == model.data
    assert [seen.host for seen in _gets(server)] == ["127.0.0.1", "localhost"]


def test_check_mode_reports_a_download_and_changes_nothing(
    server: FileServer, model: Model, tmp_path: Path
) -> None:
    params = _params(server, model, tmp_path / "models")
    Path(params["dest"] + ".part").write_bytes(model.data[:1000])

    proc, result = _run_module(params | {"_ansible_check_mode": True}, tmp_path)

    assert proc.returncode == 0, proc.stdout
    assert (result["changed"], result["size"], result["resumed_from"]) == (True, SIZE, 1000)
    assert sorted(os.listdir(tmp_path / "models")) == ["model.gguf.part"]
    assert _gets(server) == []


def test_wrong_size_is_refused_before_writing(server: FileServer, model: Model, tmp_path: Path) -> None:
    params = _params(server, model, tmp_path / "models", size=SIZE - 1)

    with pytest.raises(gd.DownloadError, match=f"{SIZE} bytes but size says {SIZE - 1}"):
        gd.ensure(params)

    assert os.listdir(tmp_path / "models") == []


# -- the token goes only over HTTPS, and only to the hosts named for it --------------------------------


@pytest.fixture
def tls_token_server(model: Model, monkeypatch: pytest.MonkeyPatch) -> Iterator[FileServer]:
    """The hub behind a token, over HTTPS with a throwaway certificate the module is told to trust."""
    with FileServer(model.root, token=TOKEN, tls=True) as srv:
        monkeypatch.setenv("SSL_CERT_FILE", str(srv.ca_file))
        yield srv


@pytest.mark.parametrize(("url", "hosts", "allowed"), [
    ("https://huggingface.co/org/repo/resolve/main/m.gguf", ["huggingface.co"], True),
    ("https://HuggingFace.co./org/repo/resolve/main/m.gguf", ["huggingface.co"], True),
    ("http://huggingface.co/org/repo/resolve/main/m.gguf", ["huggingface.co"], False),
    ("https://huggingface.co.evil.example/m.gguf", ["huggingface.co"], False),
    ("https://huggingface.co@evil.example/m.gguf", ["huggingface.co"], False),
    ("https://mirror.lan/m.gguf", ["huggingface.co"], False),
    ("https://mirror.lan:8443/m.gguf", ["huggingface.co", "mirror.lan"], True),
    ("ftp://mirror.lan/m.gguf", ["mirror.lan"], False),
])
def test_token_policy(url: str, hosts: list[str], allowed: bool) -> None:
    assert gd.token_allowed(url, hosts) is allowed
    headers = gd.request_headers({"url": url, "token": TOKEN, "token_hosts": hosts})
    assert ("Authorization" in headers) is allowed


def test_token_is_required_and_sent_over_https(tls_token_server: FileServer, model: Model, tmp_path: Path) -> None:
    params = _params(tls_token_server, model, tmp_path / "models", token_hosts=["127.0.0.1"])
    with pytest.raises(gd.DownloadError, match="HTTP 401.*token"):
        gd.ensure(params)

    result = gd.ensure(params | {"token": TOKEN})

    assert result["changed"] is True
    assert Path(params["dest"]).read_bytes() == model.data
    assert _gets(tls_token_server)[-1].authorized


@pytest.mark.parametrize("server_name, token_hosts, refusal", [
    ("token_server", ["127.0.0.1"], "HTTP 401.*only over https"),  # never over plain HTTP, even to a named host
    ("tls_token_server", None, "HTTP 401"),  # not to a host the fleet did not name (default: only huggingface.co)
])
def test_token_is_withheld(request, server_name: str, token_hosts: list[str] | None, refusal: str, model: Model,
                           tmp_path: Path) -> None:
    server: FileServer = request.getfixturevalue(server_name)
    named = {"token_hosts": token_hosts} if token_hosts else {}

    with pytest.raises(gd.DownloadError, match=refusal):
        gd.ensure(_params(server, model, tmp_path / "models", token=TOKEN, **named))

    assert server.requests and not any(seen.authorized for seen in server.requests)


def test_token_is_not_sent_to_the_host_a_redirect_points_at(
    tls_token_server: FileServer, model: Model, tmp_path: Path
) -> None:
    url = f"{tls_token_server.url}/redirect/org/repo/resolve/main/model.gguf"
    gd.ensure(_params(tls_token_server, model, tmp_path / "models", url=url, token=TOKEN,
                      token_hosts=["127.0.0.1", "localhost"]))

    hops = [(seen.host, seen.authorized) for seen in tls_token_server.requests]
    assert hops == [("127.0.0.1", True), ("localhost", False)] * 2  # HEAD, then GET


def test_token_is_kept_on_a_same_host_redirect(model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with FileServer(model.root, token=TOKEN, redirect_host="127.0.0.1", tls=True) as srv:
        monkeypatch.setenv("SSL_CERT_FILE", str(srv.ca_file))
        url = f"{srv.url}/redirect/org/repo/resolve/main/model.gguf"
        gd.ensure(_params(srv, model, tmp_path / "models", url=url, token=TOKEN, size=SIZE,
                          token_hosts=["127.0.0.1"]))
        assert [(seen.host, seen.authorized) for seen in srv.requests] == [("127.0.0.1", True)] * 2


def test_module_output_never_shows_the_token(tls_token_server: FileServer, model: Model, tmp_path: Path) -> None:
    params = _params(tls_token_server, model, tmp_path / "models", token=TOKEN, token_hosts=["127.0.0.1"])

    good, result = _run_module(params, tmp_path)
    bad, failure = _run_module(params | {"sha256": "0" * 64, "dest": str(tmp_path / "other.gguf")}, tmp_path)

    assert good.returncode == 0 and result["changed"] is True
    assert bad.returncode != 0 and failure["failed"] is True
    for proc in (good, bad):
        assert TOKEN not in proc.stdout + proc.stderr
    assert result["invocation"]["module_args"]["token"] == "VALUE_SPECIFIED_IN_NO_LOG_PARAMETER"
    assert _gets(tls_token_server)[-1].authorized


# -- a writer in the model folder cannot make root write, chown or chmod through a link -----------------

NOBODY = 65534


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the model folder that belongs to someone else, e.g. /etc/shadow."""
    path = tmp_path / "victim"
    path.write_bytes(b"precious\n")
    os.chown(path, NOBODY, NOBODY)
    path.chmod(0o600)
    return path


def _untouched(victim: Path) -> None:
    found = victim.stat()
    assert victim.read_bytes() == b"precious\n"
    assert (found.st_uid, found.st_gid, found.st_mode & 0o7777) == (NOBODY, NOBODY, 0o600)


def _run_as_ansible(params: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    proc, result = _run_module(params | {"owner": "root", "group": "root", "mode": "0640"}, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return result


@pytest.mark.parametrize("planted", [".part", ".verified", ".verified.tmp", ".lock", ""],
                         ids=["part", "marker", "marker-tmp", "lock", "model"])
def test_a_planted_link_is_never_written_through(
    server: FileServer, model: Model, tmp_path: Path, victim: Path, planted: str
) -> None:
    params = _params(server, model, tmp_path / "models")
    (tmp_path / "models" / f"model.gguf{planted}").symlink_to(victim)

    result = _run_as_ansible(params, tmp_path)

    _untouched(victim)
    dest = Path(params["dest"])
    assert result["changed"] is True and dest.read_bytes() == model.data
    assert not dest.is_symlink() and (dest.stat().st_uid, dest.stat().st_mode & 0o777) == (0, 0o640)
    assert not Path(params["dest"] + ".verified").is_symlink() and gd.is_verified(params["dest"], model.sha256)
    assert sorted(os.listdir(tmp_path / "models")) == ["model.gguf", "model.gguf.verified"]


def test_a_partial_file_hard_linked_to_another_file_is_not_appended_to(
    server: FileServer, model: Model, tmp_path: Path, victim: Path
) -> None:
    params = _params(server, model, tmp_path / "models")
    os.link(victim, params["dest"] + ".part")

    _run_as_ansible(params, tmp_path)

    _untouched(victim)
    assert Path(params["dest"]).read_bytes() == model.data


def test_a_half_download_left_by_another_user_is_not_resumed(
    server: FileServer, model: Model, tmp_path: Path
) -> None:
    """The engine account could have written any prefix: only the module's own partial files resume."""
    params = _params(server, model, tmp_path / "models")
    part = Path(params["dest"] + ".part")
    part.write_bytes(b"evil" * 1000)
    os.chown(part, NOBODY, NOBODY)

    result = _run_as_ansible(params, tmp_path)

    assert result["resumed_from"] == 0 and Path(params["dest"]).read_bytes() == model.data


def test_a_marker_forged_by_another_user_is_not_trusted(
    server: FileServer, model: Model, tmp_path: Path
) -> None:
    """Same size, same mtime, a marker naming the right sha256: written by the engine account, so hashed."""
    params = _params(server, model, tmp_path / "models")
    dest = Path(params["dest"])
    dest.write_bytes(bytes(SIZE))
    found = dest.stat()
    marker = Path(params["dest"] + ".verified")
    marker.write_text(json.dumps({"sha256": model.sha256, "size": SIZE, "mtime_ns": found.st_mtime_ns,
                                  "inode": found.st_ino, "uid": NOBODY}))
    for path in (dest, marker):
        os.chown(path, NOBODY, NOBODY)

    result = _run_as_ansible(params, tmp_path)

    assert result["changed"] is True and dest.read_bytes() == model.data
    assert dest.stat().st_uid == 0 and marker.stat().st_uid == 0


def test_a_good_file_of_another_owner_is_taken_over_without_downloading(
    server: FileServer, model: Model, tmp_path: Path
) -> None:
    """Upgrading from engine-owned models: a correct file is hashed once and becomes root's, not refetched."""
    params = _params(server, model, tmp_path / "models")
    dest = Path(params["dest"])
    dest.write_bytes(model.data)
    os.chown(dest, NOBODY, NOBODY)

    result = _run_as_ansible(params, tmp_path)

    assert result["changed"] is True and result["bytes_transferred"] == 0 and _gets(server) == []
    assert (dest.stat().st_uid, dest.stat().st_mode & 0o777) == (0, 0o640)
    again = _run_as_ansible(params, tmp_path)
    assert again["changed"] is False and "marker" in again["msg"]


def test_a_model_folder_linked_by_another_user_is_refused(
    server: FileServer, model: Model, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "etc"
    elsewhere.mkdir()
    link = tmp_path / "models"
    link.symlink_to(elsewhere)
    os.lchown(link, NOBODY, NOBODY)
    params = _params(server, model, tmp_path / "unused") | {"dest": str(link / "model.gguf")}

    proc, result = _run_module(params, tmp_path)

    assert proc.returncode != 0 and "is a link owned by nobody" in result["msg"]
    assert os.listdir(elsewhere) == [] and server.requests == []


def test_a_model_folder_linked_by_root_is_followed(server: FileServer, model: Model, tmp_path: Path) -> None:
    """Models on a bigger disk behind a link root made keep working."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "models").symlink_to(tmp_path / "disk")
    params = _params(server, model, tmp_path / "unused") | {"dest": str(tmp_path / "models" / "model.gguf")}

    _run_as_ansible(params, tmp_path)

    assert (tmp_path / "disk" / "model.gguf").read_bytes() == model.data


def test_a_folder_others_can_write_to_is_refused(server: FileServer, model: Model, tmp_path: Path) -> None:
    params = _params(server, model, tmp_path / "models")
    (tmp_path / "models").chmod(0o775)

    proc, result = _run_module(params, tmp_path)

    assert proc.returncode != 0 and "mode 0775" in result["msg"] and "not writable by group" in result["msg"]
    assert os.listdir(tmp_path / "models") == [] and server.requests == []


# -- two downloads of one file on one box take turns -----------------------------------------------------


def test_two_runs_for_one_file_take_turns(server: FileServer, model: Model, tmp_path: Path) -> None:
    """The second run waits for the first, then finds the file verified: one download, no crash."""
    params = _params(server, model, tmp_path / "models")
    server.rate = SIZE / 2  # two seconds per download: long enough to overlap
    procs = []
    for number in (1, 2):
        procs.append(subprocess.Popen(module_command("gguf_download", tmp_path, params, f"args{number}.json"),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=module_env()))
        if number == 1:  # the second starts while the first is appending to the partial file
            deadline = time.monotonic() + 30
            while not Path(params["dest"] + ".part").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not gd.is_verified(params["dest"], model.sha256)
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, out + err
        results.append(json.loads(out))

    first, second = results
    assert first["changed"] is True and first["bytes_transferred"] == SIZE
    assert second["changed"] is False and second["bytes_transferred"] == 0 and second["waited"] > 0.5
    assert len(_gets(server)) == 1 and server.bytes_sent == SIZE
    assert Path(params["dest"]).read_bytes() == model.data
    assert sorted(os.listdir(tmp_path / "models")) == ["model.gguf", "model.gguf.verified"]
