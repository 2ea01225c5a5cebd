"""Generated GGUFs carry the metadata and tensors llama.cpp's loader asks for, deterministically."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from lab.tinymodels import ARCHS, FILE_TYPES, SPECIAL_TOKENS, build_vocab, bytes_to_unicode, write_model


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


# ---------------------------------------------------------------- the scripted model (the demo box's)


def _scripted_next(reader: gguf.GGUFReader, token: int) -> np.ndarray:
    """The scripted model's logits after ``token``: with zero attention and feed-forward outputs, the output layer
    of the normalised embedding (as the engine computes it)."""
    from gguf.quants import dequantize

    weights = {t.name: dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
               for t in reader.tensors if t.name in ("token_embd.weight", "output.weight", "blk.0.attn_output.weight",
                                                      "blk.0.ffn_down.weight")}
    assert not weights["blk.0.attn_output.weight"].any() and not weights["blk.0.ffn_down.weight"].any()
    hidden = weights["token_embd.weight"][token]
    hidden = hidden / np.sqrt(np.mean(hidden ** 2) + 1e-6)
    return weights["output.weight"] @ hidden


def test_the_scripted_model_follows_each_trigger_with_its_reply_then_ends_the_turn(tmp_path: Path) -> None:
    from lab.tinymodels import AGENT_REPLIES, write_scripted_model

    reader = gguf.GGUFReader(write_scripted_model(tmp_path / "s.gguf", n_ctx_train=131072))
    tokens = [bytes(reader.fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in reader.fields["tokenizer.ggml.tokens"].data]
    end = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    assert tokens[end] == "<|im_end|>" and _field(reader, "llama.context_length") == 131072
    decode = {char: byte for byte, char in bytes_to_unicode().items()}
    for trigger, reply in AGENT_REPLIES.items():
        logits = _scripted_next(reader, tokens.index(trigger))
        said = int(np.argmax(logits))
        assert bytes(decode[char] for char in tokens[said]).decode() == reply
        assert logits[said] - np.delete(logits, said).max() > 20  # the reply, whatever the temperature
        assert int(np.argmax(_scripted_next(reader, said))) == end
    other = _scripted_next(reader, tokens.index("a"))  # an unscripted token: near-uniform, like the random models
    assert float(other.max() - other.min()) < 2


@pytest.mark.parametrize(("tools", "messages", "cue"), [
    (["Bash", "Read"], [{"role": "user", "content": "Read the file notes.txt"}], "<|read_notes|>"),
    (["Read"], [{"role": "user", "content": [{"type": "text", "text": "what is in notes.txt?"}]}], "<|read_notes|>"),
    (["Read"], [{"role": "user", "content": "Say hello"}], "<|answer|>"),  # Read offered, no file asked for
    (["get_time"], [{"role": "user", "content": "What time is it?"}], "<|get_time|>"),
    (["read", "exec"], [{"role": "user", "content": "Read notes.txt"}], "<|answer|>"),  # OpenClaw's tools
    ([], [{"role": "user", "content": "Read notes.txt"}], "<|answer|>"),
    (["Read"], [{"role": "user", "content": "Read notes.txt"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "Read", "arguments": {"file_path": "notes.txt"}}}]},
                {"role": "tool", "content": "Bananas"}, {"role": "user", "content": "<system-reminder/>"}],
     "<|answer|>"),  # a tool result came back: answer, never call again
])
def test_the_agent_template_cues_the_script(tools: list[str], messages: list[dict], cue: str) -> None:
    from jinja2 import Environment

    from lab.tinymodels import AGENT_REPLIES, AGENT_TEMPLATE

    offered = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in tools]
    env = Environment()
    env.policies["json.dumps_kwargs"] = {"sort_keys": False}
    prompt = env.from_string(AGENT_TEMPLATE).render(messages=messages, tools=offered or None,
                                                    add_generation_prompt=True)
    assert prompt.endswith(f"<|im_start|>assistant\n{cue}")
    assert sum(prompt.count(trigger) for trigger in AGENT_REPLIES) == 1
    if len(messages) > 1:  # the past call renders as the script's own call would
        assert '<tool_call>\n{"name": "Read", "arguments": {"file_path": "notes.txt"}}\n</tool_call>' in prompt
