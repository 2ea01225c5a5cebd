"""The converged fast path's proof: box_manifest records what a full run left and later names every difference
(real files, links and folders; the callback's notes from real result shapes; the digest of the inputs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ansible_collections.v100box.llm.plugins.action import box_manifest as action
from ansible_collections.v100box.llm.plugins.callback import manifest as callback
from tests.unit.plugins.loader import PLUGINS, load_module, module_env

box = load_module("box_manifest")
NO_COMMANDS = SimpleNamespace(run_command=lambda argv: (1, "", "not here"))


def _tree(root: Path) -> dict[str, dict[str, str]]:
    (root / "etc").mkdir(parents=True)
    (root / "etc/unit.service").write_text("[Service]\nExecStart=/bin/true\n")
    (root / "etc/unit.env").write_text("A=1\n")
    os.chmod(root / "etc/unit.env", 0o600)
    (root / "engine/v1").mkdir(parents=True)
    (root / "engine/v1/llama-server").write_text("binary")
    (root / "engine/current").symlink_to(root / "engine/v1")
    (root / "model.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    return {"files": {str(root / "etc"): "directory", str(root / "etc/unit.service"): "content",
                      str(root / "etc/unit.env"): "content", str(root / "engine/v1"): "tree",
                      str(root / "engine/current"): "link", str(root / "model.gguf"): "large",
                      str(root / "gone"): "absent"}}


def _record(tmp_path: Path, managed: dict) -> dict:
    path = tmp_path / "record.json"
    params = {"path": str(path), "digest": "d1", "inputs": {"llama_service_instances": "1f", "(collection)": "aa"},
              "managed": managed, "max_age_s": 3600, "health_timeout_s": 1}
    box.record(NO_COMMANDS, params)
    return params


def _check(params: dict, **changes) -> tuple[bool, list[str]]:
    converged, reasons, _entries = box.check(NO_COMMANDS, {**params, **changes})
    return converged, reasons


def test_an_untouched_box_matches_its_record(tmp_path):
    params = _record(tmp_path, _tree(tmp_path / "box"))
    assert _check(params) == (True, [])
    assert os.stat(params["path"]).st_mode & 0o777 == 0o600


@pytest.mark.parametrize(("drift", "said"), [
    (lambda root: (root / "etc/unit.service").write_text("[Service]\nExecStart=/bin/false\n"), "sha256 changed"),
    (lambda root: os.chmod(root / "etc/unit.env", 0o644), "mode changed"),
    (lambda root: os.chmod(root / "etc", 0o777), "etc: mode changed"),
    (lambda root: ((root / "engine/current").unlink(), (root / "engine/current").symlink_to("/tmp")), "target changed"),
    (lambda root: (root / "engine/v1/llama-server").write_text("other binary"), "members changed"),
    (lambda root: (root / "model.gguf").write_bytes(b"GGUF" + b"\1" * 80), "model.gguf: mtime_ns, size changed"),
    (lambda root: (root / "gone").write_text("back"), "gone is file, was absent"),
    (lambda root: (root / "etc/unit.env").unlink(), "unit.env is absent, was file"),
])
def test_each_kind_of_drift_is_named(tmp_path, drift, said):
    root = tmp_path / "box"
    params = _record(tmp_path, _tree(root))
    drift(root)
    converged, reasons = _check(params)
    assert not converged and any(said in reason for reason in reasons), reasons


def test_other_inputs_an_old_record_a_missing_one_or_full_mean_a_full_run(tmp_path):
    params = _record(tmp_path, _tree(tmp_path / "box"))
    other = {"llama_service_instances": "2e", "(collection)": "aa", "llama_service_api_key": "3d"}
    assert _check(params, digest="d2", inputs=other) == (False, ["the inputs differ from the last full run's: "
                                                                 "llama_service_api_key, llama_service_instances"])
    record = json.loads(Path(params["path"]).read_text())
    record["recorded_at"] = time.time() - 7200
    Path(params["path"]).write_text(json.dumps(record))
    converged, reasons = _check(params)
    assert not converged and "days ago" in reasons[0]
    assert _check(params, path=str(tmp_path / "none.json")) == (False, ["no record of a full run on this box"])


def test_a_server_that_does_not_answer_health_means_a_full_run(tmp_path):
    managed = {**_tree(tmp_path / "box"), "servers": {"http://127.0.0.1:9": "tiny"}}  # nothing listens on 9
    converged, reasons = _check(_record(tmp_path, managed))
    assert not converged and reasons == ["http://127.0.0.1:9/health does not answer 200"]


def test_a_record_keeps_what_earlier_runs_noted_while_it_is_on_the_box(tmp_path):
    root = tmp_path / "box"
    params = _record(tmp_path, _tree(root))
    # A converged full run skips the unpack and the download: it notes only the unit file.
    box.record(NO_COMMANDS, {**params, "managed": {"files": {str(root / "etc/unit.service"): "content"}}})
    (root / "engine/v1/llama-server").write_text("other binary")
    converged, reasons = _check(params)
    assert not converged and any("members changed" in reason for reason in reasons)


def test_the_module_runs_as_ansible_runs_it_and_says_converged(tmp_path):
    managed = _tree(tmp_path / "box")
    for state in ("record", "check"):
        args = {"state": state, "path": str(tmp_path / "r.json"), "digest": "d", "managed": managed}
        (tmp_path / "args.json").write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
        done = subprocess.run([sys.executable, str(PLUGINS / "box_manifest.py"), str(tmp_path / "args.json")],
                              capture_output=True, text=True, env=module_env(), check=False)
        answer = json.loads(done.stdout)
    assert answer["converged"] is True and answer["changed"] is False and answer["entries"] == 7, answer
    os.chmod(tmp_path / "box/etc/unit.env", 0o644)  # drift: the full run starts, and the record is gone until it ends
    done = subprocess.run([sys.executable, str(PLUGINS / "box_manifest.py"), str(tmp_path / "args.json")],
                          capture_output=True, text=True, env=module_env(), check=False)
    assert json.loads(done.stdout)["reasons"] == [f"{tmp_path}/box/etc/unit.env: mode changed"]
    assert not (tmp_path / "r.json").exists()


def test_the_callback_notes_files_units_packages_accounts_and_hidden_results():
    callback.MANAGED.clear()
    note = callback.note
    note("b", "ansible.builtin.template", {"path": "/etc/u.service", "state": "file", "changed": False}, {})
    note("b", "ansible.builtin.file", {"path": "/etc/llama", "state": "directory"}, {})
    note("b", "ansible.builtin.file", {"dest": "/opt/cpu/current", "state": "link"}, {})
    note("b", "ansible.builtin.file", {"path": "/etc/old.conf", "state": "absent"}, {})
    note("b", "ansible.builtin.copy", {"censored": "hidden", "_ansible_no_log": True},
         {"dest": "/etc/llama/keys/a.key", "mode": "0600"})
    note("b", "ansible.builtin.copy", {"censored": "hidden"}, {"dest": "{{ dir }}/b.key"})  # not templated: unknown
    note("b", "v100box.llm.safe_unpack", {"dest": "/opt/cpu/v1.partial"}, {})
    note("b", "ansible.builtin.command", {"invocation": {"module_args": {"argv": ["mv", "-T", "/opt/cpu/v1.partial",
                                                                                 "/opt/cpu/v1"]}}}, {})
    note("b", "ansible.builtin.systemd_service", {"name": "llama-a.service", "state": "started"}, {})
    note("b", "ansible.builtin.apt", {"invocation": {"module_args": {"name": ["libgomp1"], "state": "present"}}}, {})
    note("b", "ansible.builtin.user", {"name": "llama"}, {})
    note("b", "v100box.llm.account_files", {"invocation": {"module_args": {
        "account": "dev", "directories": [".local/bin"], "files": [{"path": ".local/bin/claude-a"}],
        "secret_files": {".config/keys/a.key": "x"}}}}, {})
    note("b", "v100box.llm.llama_api_check", {"health": "ok", "invocation": {"module_args": {
        "base_url": "http://127.0.0.1:8080", "model": "m"}}}, {})
    note("b", "ansible.builtin.template", {"skipped": True, "path": "/etc/skipped"}, {})
    assert callback.MANAGED["b"] == {
        "files": {"/etc/u.service": "content", "/etc/llama": "directory", "/opt/cpu/current": "link",
                  "/etc/old.conf": "absent", "/etc/llama/keys/a.key": "content", "/opt/cpu/v1": "tree",
                  "/opt/cpu/v1.partial": "absent", "~dev/.local/bin": "directory",
                  "~dev/.local/bin/claude-a": "content", "~dev/.config/keys/a.key": "content"},
        "units": {"llama-a.service": True}, "packages": {"libgomp1": True}, "accounts": {"user:llama": True},
        "servers": {"http://127.0.0.1:8080": "m"}}


def test_the_digest_follows_the_inputs_not_the_bookkeeping():
    base = {"llama_service_instances": [{"name": "a", "port": 8080}], "ansible_host": "10.0.0.5",
            "ansible_facts": {"distribution": "Debian", "os_family": "Debian"}, "inventory_hostname": "b",
            "playbook_dir": "/x", "ansible_check_mode": False}
    digest = action.inputs_digest(base)
    assert action.inputs_digest({**base, "playbook_dir": "/y", "ansible_check_mode": True, "groups": {"all": []},
                                 action.DIGEST_FACT: "old", "v100box_full_run": True,
                                 "ansible_facts": {**base["ansible_facts"], "getent_passwd": {"root": []}},
                                 "getent_passwd": {"root": []}, "ansible_limit": "b", "ansible_current_hosts": ["b"],
                                 "ansible_play_hosts_all": ["b"]}) == digest  # facts and the run's own: not inputs
    # The strategy's connection: a box provisioned under mitogen (its connection and pipelining) stays converged
    # under the plain linear strategy's ssh.
    assert action.inputs_digest({**base, "ansible_connection": "ssh"}) == digest
    assert action.inputs_digest({**base, "ansible_connection": "mitogen_ssh", "ansible_pipelining": True}) == digest
    for changed in ({"llama_service_instances": [{"name": "a", "port": 8081}]}, {"ansible_host": "10.0.0.6"},
                    {"ansible_facts": {"distribution": "Ubuntu", "os_family": "Debian"}},
                    {"llama_service_api_key": "sk-new"}):
        assert action.inputs_digest({**base, **changed}) != digest, changed


def test_the_collection_digest_follows_what_a_run_reads_not_the_docs_or_the_scenarios(tmp_path, monkeypatch):
    tree = {"galaxy.yml": "name: llm", "README.md": "docs", "CHANGELOG.md": "changes",
            "roles/r/tasks/main.yml": "- name: t", "roles/r/README.md": "role docs",
            "roles/r/templates/NOTE.md.j2": "note {{ x }}", "roles/r/molecule/default/converge.yml": "- hosts: all",
            "plugins/modules/m.py": "x = 1", "tests/unit/test_m.py": "y = 2"}

    def digest(changes: dict[str, str]) -> str:
        for name, text in {**tree, **changes}.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(text)
        monkeypatch.setattr(action, "_COLLECTION", str(tmp_path))
        action.collection_digest.cache_clear()
        return action.collection_digest()

    try:
        base = digest({})
        for docs in ({"README.md": "edited"}, {"CHANGELOG.md": "edited"}, {"roles/r/README.md": "edited"},
                     {"roles/r/molecule/default/converge.yml": "- hosts: other"}, {"tests/unit/test_m.py": "y = 3"}):
            assert digest(docs) == base, docs
            digest({name: tree[name] for name in docs})
        for read in ({"roles/r/tasks/main.yml": "- name: u"}, {"roles/r/templates/NOTE.md.j2": "note {{ y }}"},
                     {"plugins/modules/m.py": "x = 2"}, {"galaxy.yml": "name: llm2"}):
            assert digest(read) != base, read
            digest({name: tree[name] for name in read})
    finally:
        action.collection_digest.cache_clear()


def test_units_are_read_from_one_systemctl_show_and_a_stopped_or_reloaded_unit_is_named():
    def answers(active: str, reload: str) -> SimpleNamespace:
        block = ("Id={}\nLoadState=loaded\nActiveState={}\nUnitFileState=enabled\nNeedDaemonReload={}\n"
                 "DropInPaths=\nFragmentPath=/etc/systemd/system/{}\n")
        out = "\n".join(block.format(name, active, reload, name) for name in ("a.service", "b.service"))
        return SimpleNamespace(run_command=lambda argv: (0, out, ""))

    units = box._units(answers("active", "no"), ["a.service", "b.service"])
    assert units["b.service"] == {"LoadState": "loaded", "ActiveState": "active", "UnitFileState": "enabled",
                                  "NeedDaemonReload": "no", "DropInPaths": "",
                                  "FragmentPath": "/etc/systemd/system/b.service"}
    record = {"state": {"files": {}, "units": units, "packages": {}, "accounts": {}, "firewall": {}}}
    found = {"files": {}, "units": box._units(answers("inactive", "yes"), ["a.service", "b.service"]),
             "packages": {}, "accounts": {}, "firewall": {}}
    assert box.compare(record, found) == [
        "unit a.service is inactive, was active", "unit a.service: systemd runs an older copy of its unit file",
        "unit b.service is inactive, was active", "unit b.service: systemd runs an older copy of its unit file"]


@pytest.fixture(scope="module")
def tiny(llama_server, tmp_path_factory):
    from tests.unit.plugins.loader import tiny_server

    with tiny_server(llama_server, tmp_path_factory.mktemp("m"), "manifest-key-0123456789", "-c", "1024",
                     "-np", "1") as running:
        yield running


@pytest.mark.engine
def test_a_converged_box_checks_its_servers_in_the_same_module_run(tmp_path, tiny):
    """The fast path's one module run: the comparison and then llama_api_check's checks of every server, the key read
    from the server's key file on the box; a server that answers wrong fails the run naming it, and a box that differs
    from its record checks nothing (its full run checks the servers at its end)."""
    from tests.unit.plugins.loader import run_module

    (tmp_path / "tiny.key").write_text("manifest-key-0123456789\n")
    instance = {"name": "llama-tiny", "model": "tiny", "port": int(tiny.url.rsplit(":", 1)[1])}
    server = {"instance": instance, "model": "tiny", "first": True, "base_url": tiny.url,
              "api_key_file": str(tmp_path / "tiny.key")}
    args = {"state": "record", "path": str(tmp_path / "r.json"), "digest": "d", "managed": _tree(tmp_path / "box")}
    run_module("box_manifest", tmp_path, args)
    checked = {**args, "state": "check", "max_tokens": 2, "servers": [server]}
    _done, answer = run_module("box_manifest", tmp_path, checked, timeout=180)
    assert answer["converged"] is True and not answer.get("failed"), answer
    (found,) = answer["servers"]
    assert found["check"]["base_url"] == tiny.url and found["health"] == "ok" and found["served_ids"] == ["tiny"]
    assert found["openai"]["object"] == "chat.completion" and found["anthropic"]["type"] == "message"
    assert found["auth"] == {"required": True, "anonymous_status": 401, "wrong_key_status": 401}
    assert "manifest-key-0123456789" not in json.dumps(answer)

    _done, wrong = run_module("box_manifest", tmp_path, {**checked, "servers": [{**server, "model": "other"}]})
    assert wrong["failed"] and wrong["converged"] is True, wrong
    assert wrong["msg"] == f"{tiny.url}: serves ['tiny'], not other", wrong["msg"]
    _done, keyless = run_module("box_manifest", tmp_path, {**checked, "servers": [{**server, "api_key_file": ""}]})
    assert keyless["failed"] and "/v1/models answered HTTP 401" in keyless["msg"], keyless
    assert (tmp_path / "r.json").exists()  # a failed check is no drift: the record stays
    # Settings llama_api_check refuses after a full run are refused here too, before any comparison.
    _done, refused = run_module("box_manifest", tmp_path, {**checked, "throughput_runs": 0})
    assert refused["failed"] and refused["msg"] == "throughput_runs must be at least 1, not 0", refused
    assert "converged" not in refused and (tmp_path / "r.json").exists(), refused

    os.chmod(tmp_path / "box/etc/unit.env", 0o644)
    _done, drifted = run_module("box_manifest", tmp_path, {**checked, "servers": [{**server, "model": "other"}]})
    assert drifted["converged"] is False and not drifted.get("failed") and "servers" not in drifted, drifted
