"""What render hands the download roles: packs are trusted only when pinned or checked over HTTPS, and the
hub token goes to a models mirror only when the fleet says so, over HTTPS."""

from __future__ import annotations

import hashlib

import pytest
import yaml

from controller.errors import CatalogError
from controller.model.catalog import load_catalog
from lab.site import LAB_ENGINE, PACK_NAME, pinned_engine
from tests.unit.tiny_box import tiny_box_vars, tiny_catalog_file

SHA = "ab" * 32


@pytest.fixture
def catalog_file(tmp_path):
    return tiny_catalog_file(tmp_path, SHA)


def _vars(tmp_path, catalog, **mirror):
    return tiny_box_vars(tmp_path, catalog, models=[{"id": "tiny", "ctx": 2048}], mirror=mirror)


def test_a_plain_http_mirror_without_a_pinned_pack_is_refused(tmp_path, catalog_file):
    with pytest.raises(CatalogError) as refused:
        _vars(tmp_path, load_catalog([catalog_file]), engines="http://mirror.lan/engines", models="https://huggingface.co")

    message = str(refused.value)
    assert "\n" not in message and "box box1" in message and "plain HTTP" in message
    assert f"engines.{LAB_ENGINE}" in message and "packs.linux-x86_64" in message and "sha256" in message


def test_a_pinned_pack_may_come_from_a_plain_http_mirror(tmp_path, catalog_file):
    pack = tmp_path / PACK_NAME
    pack.write_bytes(b"a pack")
    pins = tmp_path / "pins.yml"
    pins.write_text(yaml.safe_dump({"engines": pinned_engine(pack)}))

    rendered = _vars(tmp_path, load_catalog([catalog_file, pins]), engines="http://mirror.lan/engines", models="https://huggingface.co")

    (entry,) = rendered["llama_engine_packs"]
    assert entry["sha256"] == hashlib.sha256(b"a pack").hexdigest()
    assert entry["sha256sums_url"] == "" and entry["url"] == f"http://mirror.lan/engines/{PACK_NAME}"


def test_an_https_mirror_may_vouch_for_its_packs(tmp_path, catalog_file):
    rendered = _vars(tmp_path, load_catalog([catalog_file]), engines="https://mirror.lan/engines", models="https://huggingface.co")

    (entry,) = rendered["llama_engine_packs"]
    assert (entry["sha256"], entry["sha256sums_url"]) == ("", "https://mirror.lan/engines/SHA256SUMS")


def test_the_token_goes_to_a_models_mirror_only_when_asked_and_over_https(tmp_path, catalog_file):
    catalog = load_catalog([catalog_file])
    engines = "https://mirror.lan/engines"

    plain = _vars(tmp_path, catalog, engines=engines, models="https://models.lan")
    asked = _vars(tmp_path, catalog, engines=engines, models="https://models.lan", models_token=True)
    with pytest.raises(CatalogError, match="plain HTTP; serve the models mirror over https or remove models_token"):
        _vars(tmp_path, catalog, engines=engines, models="http://models.lan", models_token=True)

    assert "token" not in plain["gguf_model_files"][0]
    assert asked["gguf_model_files"][0]["token"] is True
    assert asked["gguf_model_files"][0]["url"].startswith("https://models.lan/")
