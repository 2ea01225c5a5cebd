from pathlib import Path

import pytest
import yaml

from controller.errors import FleetError
from controller.model.fleet import load_fleet
from tests.cli import run_controller
from tests.unit.clean_errors import assert_one_line_error


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yml"
    path.write_text(text)
    return path


def test_defaults_apply_to_every_box_and_relative_paths_resolve(tmp_path):
    fleet = load_fleet(write(tmp_path, """
defaults: {user: llm, key: keys/id_ed25519}
catalogs: [extra.yml]
boxes:
  box3:
    address: 192.0.2.10
    models: [{id: gemma4-26b-a4b-qat-q4_0, ctx: 32768}]
  win1: {address: 192.0.2.11, os: windows, transport: winrm, user: Administrator}
"""))
    box = fleet.box("box3")
    assert box.user == "llm" and box.key == tmp_path / "keys/id_ed25519"
    assert box.effective_port == 22 and box.effective_model_dir == "/var/lib/llama/models"
    assert fleet.box("win1").effective_port == 5986 and fleet.box("win1").user == "Administrator"
    assert fleet.catalogs == [tmp_path / "extra.yml"]


def test_unknown_field_names_file_box_and_field(tmp_path):
    path = write(tmp_path, "boxes:\n  box3:\n    address: 192.0.2.10\n    gpu_count: 2\n")
    with pytest.raises(FleetError) as err:
        load_fleet(path)
    message = str(err.value)
    assert str(path) in message and "box 'box3'" in message and "gpu_count" in message and "unknown field" in message


def test_bad_values_are_reported_per_field(tmp_path):
    path = write(tmp_path, "boxes:\n  Box_3:\n    address: x\n    bind: not-an-ip\n")
    with pytest.raises(FleetError) as err:
        load_fleet(path)
    assert "'name'" in str(err.value) and "'bind'" in str(err.value)


def test_missing_file_and_invalid_yaml(tmp_path):
    with pytest.raises(FleetError, match="cannot read fleet file"):
        load_fleet(tmp_path / "nope.yml")
    with pytest.raises(FleetError, match="not valid YAML"):
        load_fleet(write(tmp_path, "boxes: [unclosed"))


def test_unknown_box_lists_known_ones(tmp_path):
    fleet = load_fleet(write(tmp_path, "boxes:\n  a1: {address: 127.0.0.1}\n"))
    with pytest.raises(FleetError, match=r"no box named 'b2' \(boxes: a1\)"):
        fleet.box("b2")


def test_secret_from_env_and_file(tmp_path, monkeypatch):
    (tmp_path / "key.txt").write_text("s3cret-from-file\n")
    fleet = load_fleet(write(tmp_path, f"""
boxes:
  a1: {{address: 127.0.0.1, api_key: {{env: TEST_API_KEY}}, hf_token: {{file: {tmp_path}/key.txt}}}}
"""))
    box = fleet.box("a1")
    monkeypatch.delenv("TEST_API_KEY", raising=False)
    with pytest.raises(FleetError, match="TEST_API_KEY is not set"):
        box.api_key.resolve("api key")
    monkeypatch.setenv("TEST_API_KEY", "from-env")
    assert box.api_key.resolve("api key") == "from-env"
    assert box.hf_token.resolve("token") == "s3cret-from-file"


def test_a_fleet_file_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    path = tmp_path / "fleet.yml"
    path.write_bytes("boxes:\n  box3: {address: 192.0.2.10, user: jos\u00e9}\n".encode("latin-1"))
    result = run_controller("render", "box3", "--fleet", str(path), timeout=60)
    assert_one_line_error(result, 2, str(path), "not UTF-8", "save the fleet file as UTF-8")


def test_an_error_quoting_brackets_prints_them_as_written(tmp_path):
    path = write(tmp_path, "boxes:\n  Box3: {address: 192.0.2.10}\n")
    result = run_controller("render", "Box3", "--fleet", str(path), timeout=60)
    assert_one_line_error(result, 2, "'^[a-z0-9][a-z0-9_-]{0,62}$'")  # not eaten as console markup


@pytest.mark.parametrize("model_id", ["../../etc/passwd", "a/b", "x\ny", "{{ lookup('pipe', 'id') }}"])
def test_a_wanted_model_id_is_a_plain_name(tmp_path, model_id):
    path = write(tmp_path, "")
    path.write_text(yaml.safe_dump({"boxes": {"box3": {"address": "192.0.2.10", "models": [{"id": model_id}]}}}))
    with pytest.raises(FleetError, match=r"box 'box3', field 'models\.0\.id'.*not a plain name"):
        load_fleet(path)
