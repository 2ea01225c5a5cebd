"""Generated GGUFs carry the metadata and tensors llama.cpp's loader asks for, deterministically."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from lab.tinymodels import ARCHS, FILE_TYPES, SPECIAL_TOKENS, build_vocab, write_model


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


@pytest.mark.parametrize("arch", ARCHS)
def test_each_arch_has_the_hyperparameters_it_was_asked_for(tmp_path: Path, arch: str) -> None:
    path = write_model(tmp_path / f"{arch}.gguf", arch, n_layer=3, n_embd=64, n_head=4, n_head_kv=2, n_ff=96,
                       n_ctx_train=2048, n_vocab=320)
    reader = gguf.GGUFReader(path)
    assert _field(reader, "general.architecture") == arch
    assert _field(reader, f"{arch}.block_count") == 3
    assert _field(reader, f"{arch}.embedding_length") == 64
    assert _field(reader, f"{arch}.attention.head_count") == 4
    assert _field(reader, f"{arch}.attention.head_count_kv") == 2
    assert _field(reader, f"{arch}.context_length") == 2048
    assert len(_field(reader, "tokenizer.ggml.tokens")) == 320
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert "<|im_start|>" in _field(reader, "tokenizer.chat_template")
    names = {t.name: t for t in reader.tensors}
    # ggml order: row length first; K is n_head_kv * head_dim wide
    assert [int(x) for x in names["blk.2.attn_k.weight"].shape] == [64, 2 * 16]
    assert [int(x) for x in names["token_embd.weight"].shape] == [64, 320]
    assert "output.weight" in names


def test_qwen3moe_has_expert_tensors_and_counts(tmp_path: Path) -> None:
    path = write_model(tmp_path / "moe.gguf", "qwen3moe", n_expert=8, n_expert_used=2, n_ff_exp=32)
    reader = gguf.GGUFReader(path)
    assert _field(reader, "qwen3moe.expert_count") == 8
    assert _field(reader, "qwen3moe.expert_used_count") == 2
    names = {t.name: t for t in reader.tensors}
    assert [int(x) for x in names["blk.0.ffn_up_exps.weight"].shape] == [64, 32, 8]
    assert [int(x) for x in names["blk.1.ffn_down_exps.weight"].shape] == [32, 64, 8]
    assert "blk.0.ffn_up.weight" not in names


def test_gemma3_stores_its_sliding_window_and_pattern(tmp_path: Path) -> None:
    path = write_model(tmp_path / "g.gguf", "gemma3", n_layer=4, sliding_window=256, swa_pattern=2)
    reader = gguf.GGUFReader(path)
    assert _field(reader, "gemma3.attention.sliding_window") == 256
    assert _field(reader, "gemma3.attention.sliding_window_pattern") == 2
    names = {t.name for t in reader.tensors}
    assert {"blk.3.post_attention_norm.weight", "blk.3.post_ffw_norm.weight", "blk.0.attn_q_norm.weight"} <= names


@pytest.mark.parametrize("file_type", sorted(FILE_TYPES))
def test_weights_use_the_requested_encoding_and_norms_stay_f32(tmp_path: Path, file_type: str) -> None:
    path = write_model(tmp_path / "m.gguf", "llama", file_type=file_type)
    reader = gguf.GGUFReader(path)
    qtype, ftype = FILE_TYPES[file_type]
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == qtype
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert _field(reader, "general.file_type") == int(ftype)


def test_same_arguments_give_identical_bytes_and_a_new_seed_changes_them(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a.gguf", "qwen3moe", file_type="q8_0")
    b = write_model(tmp_path / "b.gguf", "qwen3moe", file_type="q8_0")
    c = write_model(tmp_path / "c.gguf", "qwen3moe", file_type="q8_0", seed=1)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_weights_are_small_random_values_not_zeros(tmp_path: Path) -> None:
    reader = gguf.GGUFReader(write_model(tmp_path / "m.gguf", "llama", file_type="f32"))
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    data = np.asarray(q.data, dtype=np.float32)
    assert 0.01 < float(data.std()) < 0.03
    norm = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
    assert np.all(np.asarray(norm.data) == 1.0)


def test_vocab_is_byte_level_bpe_with_valid_merges_and_control_tokens() -> None:
    tokens, types, merges = build_vocab(300)
    assert len(tokens) == len(types) == 300
    assert tokens[-3:] == list(SPECIAL_TOKENS)
    assert types[-3:] == [int(gguf.TokenType.CONTROL)] * 3
    assert len(set(tokens)) == 300
    for merge in merges:
        left, right = merge.split(" ")
        assert left + right in tokens
    # more tokens than merges available: padded with unused placeholders, still unique
    big_tokens, big_types, _ = build_vocab(2000)
    assert len(set(big_tokens)) == 2000 and int(gguf.TokenType.UNUSED) in big_types


def test_header_only_file_stops_before_tensor_data(tmp_path: Path) -> None:
    full = write_model(tmp_path / "full.gguf", "llama", file_type="f32")
    head = write_model(tmp_path / "head.gguf", "llama", file_type="f32", header_only=True)
    assert head.stat().st_size < 20_000 < full.stat().st_size
    assert full.read_bytes().startswith(head.read_bytes())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "mamba"}, "not one of"),
        ({"n_head": 4, "n_head_kv": 3}, "multiple of n_head_kv"),
        ({"file_type": "q4_0", "n_ff": 80}, "multiples of 32"),
        ({"file_type": "q3_k"}, "file_type"),
        ({"n_vocab": 100}, "at least"),
    ],
)
def test_shapes_the_engine_would_refuse_are_rejected_up_front(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_model(tmp_path / "bad.gguf", **kwargs)
